"""A share of an input's rows, in the `datasets` split syntax that Axolotl and TRL pass to
`datasets.load_dataset(..., split=...)`: `train[:20%]`, `train[10:100]`, `train[-5%:]`,
`train[:1000]`, `train[:33%](pct1_dropremainder)`.

An input names it after its split: `org/name:train[:20%]` (a Hub dataset), `data.jsonl:train[:20%]`
(a local file, a folder or a glob: its rows are `datasets`' one split, `train`). The rows chosen are
the rows `datasets` chooses (`datasets.arrow_reader`: `_rel_to_abs_instr`, percent boundaries
rounded to the closest row by default), counted over every file of the input in order.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pipeline.errors import UserError

HF_FILES = "hf://datasets/"  # files of a Hub dataset's repo: hf://datasets/org/name[@rev]/PATH (`pipeline.read.sources`)
SPLIT_NAME = r"\w+(?:\.\w+)*"  # datasets' split names (datasets.splits._split_re)
# an input that ends in a sliced split: BASE:SPLIT[FROM:TO](ROUNDING)
_SLICED = re.compile(rf"^(?P<base>.+):(?P<split>{SPLIT_NAME})\[(?P<bounds>[^\]]*)\](?:\((?P<rounding>[^)]*)\))?$")
_BOUNDS = re.compile(r"^(?:(?P<from>-?[\d_]+)(?P<from_pct>%)?)?:(?:(?P<to>-?[\d_]+)(?P<to_pct>%)?)?$")
ROUNDINGS = ("closest", "pct1_dropremainder")
SYNTAX = "SPLIT[FROM:TO] with whole numbers or percents (train[:20%], train[10:100], train[-5%:])"


@dataclass(frozen=True)
class Share:
    """A slice of a split as `datasets.ReadInstruction` holds it: bounds in rows or percent."""

    text: str  # as written, e.g. "train[:20%]"
    start: int | None
    stop: int | None
    percent: bool
    rounding: str | None  # percent slices only: closest (the default) or pct1_dropremainder

    def rows(self, total: int) -> tuple[int, int]:
        """[start, stop) of the split's `total` rows, as `datasets` computes them."""
        start, stop = self.start, self.stop
        if self.percent:
            if self.rounding == "pct1_dropremainder":
                if total < 100:
                    raise UserError(
                        f"{self.text}: pct1_dropremainder rounding needs a split of at least 100 "
                        f"examples (this one has {total}): drop the (pct1_dropremainder)"
                    )
                to_rows = lambda pct: pct * math.trunc(total / 100.0)
            else:
                to_rows = lambda pct: round(pct * total / 100.0)  # int: Python's round, as datasets'
            start = 0 if start is None else to_rows(start)
            stop = total if stop is None else to_rows(stop)
        else:
            start = 0 if start is None else start
            stop = total if stop is None else stop
        if start < 0:
            start = max(total + start, 0)
        if stop < 0:
            stop = max(total + stop, 0)
        return min(start, total), min(stop, total)


def split_share(spec: str) -> tuple[str, str, Share] | None:
    """(the input without its slice, the split's name, the share) of an input that ends in
    `:SPLIT[FROM:TO]`, None for any other; a slice that `datasets` would not read is one line."""
    match = _SLICED.match(spec)
    if match is None:
        return None
    split, rounding = match.group("split"), match.group("rounding")
    text = spec[len(match.group("base")) + 1 :]
    bounds = _BOUNDS.match(match.group("bounds"))
    if bounds is None:
        raise UserError(f"{spec}: {text} is no slice of a split: write {SYNTAX}")
    percent = bool(bounds.group("from_pct") or bounds.group("to_pct"))
    start, stop = (int(bounds.group(k)) if bounds.group(k) else None for k in ("from", "to"))
    if rounding is not None and (not percent or rounding not in ROUNDINGS):
        raise UserError(
            f"{spec}: rounding ({rounding}) is for percent slices only and is one of {', '.join(ROUNDINGS)}: remove it or fix it"
        )
    if percent and any(b is not None and abs(b) > 100 for b in (start, stop)):
        raise UserError(f"{spec}: percent bounds lie between -100% and 100%: fix the slice")
    if percent and rounding is None:
        rounding = "closest"
    return match.group("base"), split, Share(text, start, stop, percent, rounding)


def assign(share: Share, counts: list[int], where: str) -> list[tuple[int, int] | None]:
    """Per file of an input (their row counts `counts`, in order): the [start, stop) of its own rows
    that `share` of their concatenation keeps, None for a file it keeps none of. A share that keeps
    no row at all is one line (`where` names the input)."""
    start, stop = share.rows(sum(counts))
    if stop < start:  # datasets reads these inconsistently: to the split's end when one row short, else nothing
        raise UserError(
            f"{where}: {share.text} ends (row {stop}) before it starts (row {start}) of its {sum(counts)} "
            "examples: write the bounds in order"
        )
    if stop == start:
        raise UserError(f"{where}: {share.text} selects no examples of its {sum(counts)}: widen the slice")
    out: list[tuple[int, int] | None] = []
    offset = 0
    for n in counts:
        first, last = max(start - offset, 0), min(stop - offset, n)
        out.append((first, last) if first < last else None)
        offset += n
    return out
