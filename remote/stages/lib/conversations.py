"""The conversations a prepare stage starts from: ``pipeline.dataset`` read, checked and normalised.

Shared by both generations' prepare (the dataset forms and the one-line errors are the harness's, not a
speculators line's). ``pipeline.dataset`` is ``builtin:<name>`` (``remote/stages/data/<name>.jsonl``), a
local .jsonl/.json/.parquet file, or a hub dataset id with ``pipeline.dataset_split``; rows are ShareGPT
(``conversations: [{from, value}]``) or OpenAI (``messages: [{role, content}]``), normalised with the
installed speculators' own ``_normalize_conversation``. A JSON file with a line that does not parse stops
the stage with one line naming the file and the line.
"""
import json
from pathlib import Path

from stages import common


def check_json(path: Path, stage: str):
    """Stop at the first line of a JSON dataset file that does not parse, in one line naming the file
    and the line (datasets' loader names neither, in three chained tracebacks). JSON lines (a .jsonl,
    or a .json whose first line is an object) are read line by line, any other .json as one document."""
    def bad(line: int, problem: str):
        common.fail(stage, f"dataset {path}:{line}: {problem}; fix that line or pipeline.dataset")

    with open(path, "rb") as f:
        first = next((line for line in f if line.strip()), b"")
        if path.suffix == ".json" and not isinstance(_parsed(first), dict):  # one JSON document
            f.seek(0)
            raw = f.read()
            try:
                json.loads(raw)
            except UnicodeDecodeError as e:
                bad(raw[:e.start].count(b"\n") + 1, "not UTF-8 text")
            except json.JSONDecodeError as e:
                bad(e.lineno, f"not valid JSON ({e.msg}, column {e.colno})")
            return
        f.seek(0)
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip(b"\r\n"))  # a column past the end, not on the next line
            except UnicodeDecodeError:
                bad(number, "not UTF-8 text")
            except json.JSONDecodeError as e:
                bad(number, f"not valid JSON ({e.msg}, column {e.colno})")
            if not isinstance(row, dict):
                bad(number, f"a JSON {type(row).__name__}, not an object (one conversation per line)")


def _parsed(line: bytes):
    try:
        return json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        return None


def load_conversations(name: str, split: str, stage: str) -> list[list[dict]]:
    """The dataset's rows as role/content turn lists (speculators' normalisation of ShareGPT/OpenAI)."""
    from datasets import load_dataset

    _normalize_conversation = common.data_generation("preprocessing")._normalize_conversation  # 0.3 to 0.9 alike

    if name.startswith("builtin:"):
        path = common.BUILTIN_DATA / (name.split(":", 1)[1] + ".jsonl")
        if not path.is_file():
            shipped = ", ".join("builtin:" + p.stem for p in sorted(common.BUILTIN_DATA.glob("*.jsonl")))
            common.fail(stage, f"no built-in dataset {name!r} (shipped: {shipped}); fix pipeline.dataset")
        check_json(path, stage)
        rows = load_dataset("json", data_files=str(path), split="train")
    elif name.endswith((".jsonl", ".json", ".parquet")) or Path(name).expanduser().exists():
        path = Path(name).expanduser()
        if not path.is_file():
            common.fail(stage, f"dataset file not found: {path}; fix pipeline.dataset")
        kind = "parquet" if path.suffix == ".parquet" else "json"
        if kind == "json":
            check_json(path, stage)
        rows = load_dataset(kind, data_files=str(path), split="train")
    else:
        try:
            rows = load_dataset(name, split=split)
        except Exception as e:  # the hub's messages are long; keep the first line
            common.fail(stage, f"cannot load hub dataset {name!r}: {str(e).splitlines()[0]}; fix pipeline.dataset")

    column = next((c for c in ("conversations", "messages") if c in rows.column_names), None)
    if column is None:
        common.fail(stage, f"dataset {name!r} has neither a 'conversations' (ShareGPT) nor a 'messages' "
                           f"(OpenAI) column (it has {rows.column_names}); fix pipeline.dataset")
    return [_normalize_conversation(conv) for conv in rows[column] if conv]


def split(conversations: list[list[dict]], samples: int, heldout: int, seed: int, stage: str):
    """(training conversations, held-out ones): shuffled with ``seed``, the first ``samples`` for
    training and the next ``heldout`` for evaluate only (never trained on)."""
    import random

    random.Random(seed).shuffle(conversations)
    if len(conversations) < samples + heldout:
        common.fail(stage, f"dataset has {len(conversations)} conversations, fewer than pipeline.samples "
                           f"({samples}) + pipeline.heldout ({heldout}); lower them or use a bigger dataset")
    return conversations[:samples], conversations[samples:samples + heldout]


def write_messages(path: Path, conversations: list[list[dict]]) -> None:
    """One ``{"messages": [...]}`` per line (the OpenAI form speculators' CLIs read)."""
    with open(path, "w") as f:
        for conv in conversations:
            f.write(json.dumps({"messages": conv}) + "\n")


def write_heldout(path: Path, held: list[list[dict]]) -> None:
    """evaluate's prompts: each held-out conversation up to and including its first user turn."""
    prompts = []
    for conv in held:
        first_user = next((i for i, t in enumerate(conv) if t["role"] == "user"), None)
        if first_user is not None:
            prompts.append(conv[:first_user + 1])
    write_messages(path, prompts)
