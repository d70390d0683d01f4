"""scripts/benchlib/ring_peer.py (the ring-flash-attn peer of `pack-train --context-parallel N`) on the CPU:
with an exact reference in place of the ring function (`--fake-ring`), two gloo ranks each holding
half of a padded row give the loss and LoRA gradients of the examples run one by one in a single
process; a forward that never reaches the ring function stops the run. Needs no ring_flash_attn."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # scripts.benchlib
sys.path.insert(0, str(REPO / "tests"))

pytest.importorskip("peft")

from gloo_ranks import run_on_ranks  # noqa: E402

from scripts.benchlib import ring_attention as ra  # noqa: E402
from scripts.benchlib import ring_peer as rp  # noqa: E402

LENGTHS = [37, 100, 5, 59]  # 201 tokens: one pad token on 2 ranks; the 100-token example spans both


def _row(vocab: int = 4096) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, sum(LENGTHS))
    labels = ids.copy()
    starts = np.concatenate([[0], np.cumsum(LENGTHS)[:-1]])
    labels[starts] = -100  # the shard contract
    labels[starts + 2] = -100  # and a prompt token in each example
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": np.concatenate([np.arange(n) for n in LENGTHS]),
        "seq_lens": np.array(LENGTHS),
    }


def _compare_rank(rank: int, world: int, skip_sync: bool = False) -> dict[str, float]:
    import torch

    if skip_sync:  # the negative control: each rank keeps its partial gradients
        rp.sync_grads = lambda params, group: None

    cpu = torch.device("cpu")
    row = _row()
    model = rp.build_peer_model("tiny", 4096, cpu, lora_r=4, seed=0, attn="sdpa", init_lora_weights=False)
    params = [p for p in model.parameters() if p.requires_grad]
    # the reference: each example alone through the plain model, one process
    edges = np.concatenate([[0], np.cumsum(LENGTHS)])
    loss_tokens = int((row["labels"][1:] != -100).sum())
    want_loss = 0.0
    for a, b in zip(edges[:-1], edges[1:]):
        targets = np.concatenate([row["labels"][a + 1 : b], [-100]])
        loss = rp.loss_sum(model, torch.from_numpy(row["input_ids"][a:b]), torch.arange(b - a), torch.from_numpy(targets)) / loss_tokens
        loss.backward()
        want_loss += float(loss)
    want = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    # the peer: this rank's half of the padded row, the reference ring, gradients summed over the ranks
    share = rp.row_share(row, rank, world)
    calls, state = ra.RingCalls(), ra.ReferenceRing(cu_seqlens=torch.from_numpy(share.cu_seqlens))
    with ra.fake_ring(state, calls):
        got_loss = float(rp.peer_backward(model, share, cpu, None, calls=calls, layers=2, what="the reference"))
    grad = max(float((p.grad - w).norm() / w.norm()) for p, w in zip(params, want))
    return {
        "loss": abs(got_loss - want_loss) / want_loss,
        "grad": grad,
        "zero_grads": sum(int(w.norm() == 0) for w in want),
        "loss_tokens": share.loss_tokens,
        "row_tokens": share.row_tokens,
        "share": len(share.input_ids),
    }


def test_two_ranks_give_the_examples_loss_and_lora_gradients() -> None:
    results = run_on_ranks(_compare_rank, 2, deadline_s=240)
    for r in results:
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5, results
        assert r["zero_grads"] == 0  # every adapter matrix has a gradient to compare (random B)
        assert (r["row_tokens"], r["share"]) == (201, 101)  # padding is not a token of the row
        assert r["loss_tokens"] == 201 - 2 * len(LENGTHS)


def test_negative_control_partial_gradients_differ() -> None:
    results = run_on_ranks(_compare_rank, 2, args=(True,), deadline_s=240)
    assert all(r["grad"] > 1e-2 and r["loss"] < 1e-5 for r in results), results


def test_an_unpatched_forward_stops_the_run() -> None:
    """Without the ring (plain sdpa on this rank's share) the count is 0: SystemExit, no numbers."""
    import torch

    model = rp.build_peer_model("tiny", 4096, torch.device("cpu"), lora_r=4, seed=0, attn="sdpa")
    share = rp.row_share(_row(), 0, 1)
    with pytest.raises(SystemExit, match="called 0 times in the first forward, not once per decoder layer"):
        rp.peer_backward(model, share, torch.device("cpu"), None, calls=ra.RingCalls(), layers=2, what="the ring attention function")


def test_row_share_pads_to_a_multiple_of_the_ranks() -> None:
    row = _row()
    shares = [rp.row_share(row, r, 4) for r in range(4)]
    assert [len(s.input_ids) for s in shares] == [51] * 4  # 201 + 3 pad tokens
    assert np.concatenate([s.input_ids for s in shares])[:201].tolist() == row["input_ids"].tolist()
    targets = np.concatenate([s.targets for s in shares])
    assert targets[:200].tolist() == row["labels"][1:].tolist() and (targets[200:] == -100).all()
    assert shares[0].cu_seqlens.tolist() == [0, 37, 137, 142, 201, 204]


# A child process (flash_attn stubbed there only): ring_attention.install_ring under the installed
# transformers, then a tiny Llama's forward with config._attn_implementation "flash_attention_2";
# the ring kernel (faked by causal sdpa on the local tokens) must be reached once per layer.
_ADAPTER_CHILD = r"""
import importlib.machinery, sys, types
import numpy as np, torch, torch.nn.functional as F
interface = types.ModuleType("flash_attn.flash_attn_interface")
for name in ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward", "_flash_attn_forward",
             "_flash_attn_backward"):
    setattr(interface, name, None)
package = types.ModuleType("flash_attn")
package.flash_attn_interface, package.__version__ = interface, "2.8.3"
package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
interface.__spec__ = importlib.machinery.ModuleSpec("flash_attn.flash_attn_interface", None)
sys.modules.update({"flash_attn": package, "flash_attn.flash_attn_interface": interface})
from scripts.benchlib import ring_attention as ra, ring_peer as rp
adapter = ra.import_adapter()
def kernel(q, k, v, **kwargs):  # [tokens, heads, dim]
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                          v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
adapter.llama3_flash_attn_varlen_func = kernel
adapter.DATA_PARAMS.update(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, local_k_slice=None)
calls = ra.RingCalls()
how = ra.install_ring(None, 1, calls)
model = rp.build_peer_model("tiny", 4096, torch.device("cpu"), lora_r=4, seed=0, attn="sdpa")
model.get_base_model().config._attn_implementation = "flash_attention_2"
ids = torch.arange(3, 10)
rp.loss_sum(model, ids, torch.arange(7), ids)
print(calls.n, how)
"""


@pytest.mark.skipif(importlib.util.find_spec("ring_flash_attn") is None, reason="ring_flash_attn is not installed")
def test_the_adapter_reaches_the_ring_kernel_once_per_layer() -> None:
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run([sys.executable, "-c", _ADAPTER_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    count, how = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(count) == 2, done.stdout  # the tiny preset's 2 decoder layers
    assert how, done.stdout
