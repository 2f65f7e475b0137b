"""Token rows as batches: right padding, and the leading tokens every row of a batch shares."""

SHARED_PREFIX_MIN = 8  # a shorter shared prefix is not worth a forward call of its own


def shared_prefix(rows: list[list[int]]) -> int:
    """How many leading tokens every row of a batch shares (a chat template's system prompt), for
    generation and capture to run once: at most the shortest row's length - 1, so every row keeps a
    token of its own; 0 for a single row or fewer than ``SHARED_PREFIX_MIN`` shared tokens."""
    if len(rows) < 2:
        return 0
    shared, shortest = 0, min(len(row) for row in rows)
    while shared < shortest - 1 and all(row[shared] == rows[0][shared] for row in rows):
        shared += 1
    return shared if shared >= SHARED_PREFIX_MIN else 0


def right_padded(sequences) -> "torch.Tensor":
    """Token sequences as one ``[rows, longest]`` batch, right-padded with 0: with causal attention a
    real token never sees the padding after it, so no attention mask is needed."""
    import torch

    batch = torch.zeros((len(sequences), max(len(s) for s in sequences)), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        batch[row, :len(sequence)] = torch.as_tensor(sequence)
    return batch
