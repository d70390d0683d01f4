"""`pack-train --unfrozen-parameters REGEX ...` (Axolotl's `unfrozen_parameters`): a full fine-tune
in which only the model's parameters whose name a pattern matches train; every other parameter is
frozen (requires_grad False), so the optimizer holds no state for it and it never changes.

Patterns are read as Axolotl 0.19.0 reads them (utils/freeze.py: `freeze_layers_except` and
`LayerNamePattern`): each '.' that is not followed by '+' is a literal dot, and a pattern matches a
name with `re.match` (from the name's start, to any end: `^` is implied, `$` is not). The names are
the model's own `named_parameters()` before anything wraps it (model.layers.0.mlp.up_proj.weight,
lm_head.weight; a weight tied to another is named once, by its first name), the names Axolotl's
full fine-tune matches.

Example: `model.layers.1.` matches model.layers.1.self_attn.q_proj.weight but not
model.layers.10.mlp.up_proj.weight; `^lm_head.*` matches lm_head.weight.
"""

from __future__ import annotations

import re

import torch

from pipeline.contract import UserError

# Axolotl's LayerNamePattern._parse_pattern: a trailing [start:end] unfreezes part of a tensor
_RANGE = re.compile(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$")


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The regex Axolotl matches `pattern` as, or one line for a pattern pack-train cannot honour."""
    flag = f"--unfrozen-parameters {pattern!r}"
    if _RANGE.match(pattern):
        raise UserError(
            f"{flag}: a range [start:end] trains part of a tensor (Axolotl zeroes the other rows' "
            "gradients), which pack-train does not do: remove the range to train the whole tensor"
        )
    try:
        return re.compile(re.sub(r"\.(?!\+)", "\\.", pattern))  # as LayerNamePattern.__init__ compiles it
    except re.error as exc:
        raise UserError(f"{flag} is not a regular expression ({exc}): fix it") from None


def unfreeze_only(model: torch.nn.Module, patterns: tuple[str, ...] | list[str]) -> tuple[int, int, int, int]:
    """Freeze every parameter of `model` except those a pattern matches; a pattern that matches no
    parameter is refused, naming it and some names it could match. Returns (tensors that train,
    tensors, parameters that train, parameters)."""
    regexes = [(p, pattern_regex(p)) for p in patterns]
    named = list(model.named_parameters())
    unmatched = [p for p, regex in regexes if not any(regex.match(name) for name, _ in named)]
    if unmatched:
        examples = ", ".join(name for name, _ in named[:2]) + (f", ..., {named[-1][0]}" if len(named) > 2 else "")
        raise UserError(
            f"--unfrozen-parameters {', '.join(map(repr, unmatched))}: "
            f"{'matches' if len(unmatched) == 1 else 'match'} no parameter of the model, whose names are "
            f"{examples} (a pattern matches from the name's start; a '.' is a dot): fix or remove it"
        )
    trained = tensors = 0
    for name, param in named:
        param.requires_grad_(any(regex.match(name) for _, regex in regexes))
        trained += param.numel() if param.requires_grad else 0
        tensors += int(param.requires_grad)
    return tensors, len(named), trained, sum(p.numel() for _, p in named)
