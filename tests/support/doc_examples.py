"""The CLI output the README shows, against what the CLI prints now.

Examples are compared by shape: node addresses, long hex ids and numbers become placeholders
and runs of spaces one space (column widths follow the numbers); everything else (the checks,
their order, verdicts and wording) must be the same. ``HMA_WRITE_DOC_EXAMPLES=1`` makes the test
write the run's output into the README instead, to regenerate the example from a real run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
WRITE_ENV = "HMA_WRITE_DOC_EXAMPLES"
_NODE = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}:\d+\b")
_HEX = re.compile(r"\b[0-9a-f]{12,}\b")
_NUMBER = re.compile(r"\d+(?:\.\d+)*")
_WORDS = dict(
    enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
        ]
    )
)


def shape(text: str) -> list[str]:
    """``text``'s lines with the parts that change from run to run as placeholders."""
    out = []
    for line in text.strip("\n").splitlines():
        line = _NODE.sub("<node>", line)
        line = _HEX.sub("<hex>", line)
        line = _NUMBER.sub("<n>", line)
        out.append(" ".join(line.split()))
    return out


def abridge_doctor(output: str) -> str:
    """``doctor``'s output as the README shows it: every check of the first node, then one
    line naming the other nodes and how many checks each had (as a word, so a new check per
    node shows as a change)."""
    lines = output.strip("\n").splitlines()
    per_node = [(line, _NODE.search(line.split(None, 2)[2])) for line in lines]
    nodes = list(dict.fromkeys(m.group(0) for line, m in per_node if m and ":" in line))
    if len(nodes) < 2:
        return output.strip("\n")
    first = nodes[0]
    kept = [line for line, m in per_node if not (m and m.start() == 0 and m.group(0) != first)]
    mine = [idx for idx, line in enumerate(kept) if f" {first}: " in line]
    others = " and ".join(nodes[1:])
    # Where the other nodes' checks were: right after the first node's.
    kept.insert(mine[-1] + 1, f"...   (the same {_WORDS[len(mine)]} checks for {others})")
    return "\n".join(kept)


def readme_example(command: str) -> tuple[str, str]:
    """The README's ``$ hma-redis <command>`` line (found by shape: its ids may differ) and
    the lines it shows after it, up to the next blank line or the end of the block."""
    text = README.read_text()
    wanted = shape(f"$ hma-redis {command}")
    (line,) = [x for x in text.splitlines() if x.startswith("$ hma-redis") and shape(x) == wanted]
    start = text.index(line + "\n") + len(line) + 1
    end = min(text.index("\n\n", start), text.index("\n```", start))
    return line, text[start:end]


def check_readme_example(command: str, output: str) -> None:
    """Fail unless the README's example of ``command`` has the shape of ``output`` (or write
    ``command`` and ``output`` into the README with ``HMA_WRITE_DOC_EXAMPLES=1``)."""
    line, shown = readme_example(command)
    if os.environ.get(WRITE_ENV) == "1":
        new = f"$ hma-redis {command}\n{output.strip(chr(10))}"
        README.write_text(README.read_text().replace(f"{line}\n{shown}", new, 1))
        return
    assert shape(shown) == shape(output), (
        f"README's `hma-redis {command}` example drifted from what it prints now; regenerate "
        f"it ({WRITE_ENV}=1) or fix it. Now:\n{output}"
    )
