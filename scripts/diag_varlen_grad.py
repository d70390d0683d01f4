"""Diagnose torch varlen FlashAttention gradients against a per-example float32 reference (GPU)."""
import torch, torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

torch.manual_seed(0)
dev = "cuda"

def ref(q, k, v, do, lens):
    outs, dq, dk, dv = [], [], [], []
    s = 0
    for n in lens:
        qi, ki, vi = (x[s:s+n].float().detach().requires_grad_() for x in (q, k, v))
        o = F.scaled_dot_product_attention(qi.transpose(0,1), ki.transpose(0,1), vi.transpose(0,1), is_causal=True).transpose(0,1)
        o.backward(do[s:s+n].float()); outs.append(o.detach()); dq.append(qi.grad); dk.append(ki.grad); dv.append(vi.grad); s += n
    return [torch.cat(t) for t in (outs, dq, dk, dv)]

def rel(a, b): return ((a.float()-b.float()).norm()/b.float().norm()).item()

def aten_fn(q, k, v, cu, m):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, True, False)[0]

def varlen_fn(q, k, v, cu, m):
    return varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0))

for D in (16, 64, 128):
    for lens in ([512]*8, [100, 900, 37, 1500, 300, 1259], [4096]):
        T = sum(lens); H = 16
        q, k, v, do = (torch.randn(T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
        R = ref(q, k, v, do, lens)
        for name, fn in (("varlen", varlen_fn), ("aten", aten_fn)):
            qb, kb, vb = (x.clone().requires_grad_() for x in (q, k, v))
            o = fn(qb, kb, vb, cu, max(lens)); o.backward(do)
            errs = [rel(a, b) for a, b in zip((o, qb.grad, kb.grad, vb.grad), R)]
            print(f"D={D:3d} lens={str(lens)[:30]:30s} {name:6s} out {errs[0]:.1e} dq {errs[1]:.1e} dk {errs[2]:.1e} dv {errs[3]:.1e}")
