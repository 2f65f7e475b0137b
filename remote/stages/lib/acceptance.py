"""Acceptance length, computed exactly along the target's own greedy continuation (both evaluates).

Greedy chain verification makes the output the target's greedy continuation whatever the draft proposes,
so the accepted count of every step follows from the continuation and, at each position, the chain of
k tokens the draft proposes there: ``walk`` replays the steps; ``summary`` gives the figures.
"""


def walk(sequence: list[int], chains: list[list[int]], prompt_len: int, k: int) -> list[int]:
    """Accepted counts of each step of greedy chain verification along the target's continuation."""
    accepted, t, last = [], prompt_len, len(sequence) - 1
    while t < last:  # x_t is the newest verified token; the draft proposes from position t-1
        a = 0
        # accepted drafts are x_{t+1}..x_{t+a}; the target's own token x_{t+a+1} must still be in the
        # continuation (a draft EOS, or one past max_new_tokens, would end generation instead)
        while a < k and t + a + 2 <= last and chains[t - 1][a] == sequence[t + 1 + a]:
            a += 1
        accepted.append(a)
        t += a + 1
    return accepted


def summary(accepted: list[int], k: int) -> dict:
    """acceptance_length = mean(accepted + 1) over the steps, and per draft position the fraction of
    the steps whose chain reached it that accepted it."""
    steps = len(accepted)
    reached = [sum(1 for a in accepted if a >= s) for s in range(k + 1)]
    return {
        "acceptance_length": round(sum(a + 1 for a in accepted) / steps, 4) if steps else 1.0,
        "k": k, "steps": steps,
        "acceptance_rate_per_position": [round(reached[s + 1] / reached[s], 4) if reached[s] else 0.0
                                         for s in range(k)],
    }
