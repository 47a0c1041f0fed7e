"""PyTorch's flex_attention over the batch packed as one sequence: each sequence's pages gathered into one
contiguous K/V, a document mask keeping every query row to its own sequence, bottom-right causal and window
in the mask, soft-cap as a score_mod. Returns flex's LSE (natural log; none from compiled flex on the CPU,
which does not support it). `torch-flex` compiles flex_attention
(the fused Triton kernel on CUDA; one compilation per case shape); `torch-flex-eager` runs it uncompiled
(an unfused implementation)."""
import torch

from .pages import gather


def _make(compiled):
    cache = {}

    def flex(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap):
        from torch.nn.attention import flex_attention as fa

        dev = q.device
        t, hq, d = q.shape
        qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
        ks, vs, kdoc, kpos, qdoc, qpos = [], [], [], [], [], []
        for s, n in enumerate(lens):
            a, b = qsl[s], qsl[s + 1]
            ks.append(gather(k_cache, block_table, s, n))
            vs.append(gather(v_cache, block_table, s, n))
            kdoc.append(torch.full((n,), s, device=dev))
            kpos.append(torch.arange(n, device=dev))
            qdoc.append(torch.full((b - a,), s, device=dev))
            qpos.append(torch.arange(n - (b - a), n, device=dev))
        k, v = torch.cat(ks), torch.cat(vs)
        kdoc, kpos, qdoc, qpos = (torch.cat(x) for x in (kdoc, kpos, qdoc, qpos))

        def mask_mod(bi, h, qi, ki):
            m = (qdoc[qi] == kdoc[ki]) & (kpos[ki] <= qpos[qi])
            if window > 0:
                m = m & (kpos[ki] > qpos[qi] - window)
            return m

        def score_mod(score, bi, h, qi, ki):
            return softcap * torch.tanh(score / softcap)

        bm = fa.create_block_mask(mask_mod, 1, None, t, k.shape[0], device=dev)
        fn = fa.flex_attention
        if compiled:
            if "fn" not in cache:
                # Every case has other shapes and closures: without a higher limit dynamo would fall back to
                # the unfused eager path after 8 recompilations, and later cases would not test the kernel.
                for knob in ("recompile_limit", "cache_size_limit"):
                    if hasattr(torch._dynamo.config, knob):
                        setattr(torch._dynamo.config, knob, 10_000)
                cache["fn"] = torch.compile(fa.flex_attention)
            fn = cache["fn"]
        kw = dict(score_mod=score_mod if softcap > 0 else None, block_mask=bm, scale=scale, enable_gqa=True)
        Q, K, V = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
        if compiled and dev.type == "cpu":
            # Compiled flex on the CPU returns no LSE ("return_lse is not supported yet"): output only.
            return fn(Q, K, V, **kw)[0].transpose(0, 1), None
        if hasattr(fa, "AuxRequest"):
            out, aux = fn(Q, K, V, return_aux=fa.AuxRequest(lse=True), **kw)
            lse = aux.lse
        else:
            out, lse = fn(Q, K, V, return_lse=True, **kw)
        return out[0].transpose(0, 1), lse[0].transpose(0, 1)

    flex.versions = lambda: {"torch": torch.__version__, "flex_attention": "torch.compile" if compiled else "eager"}
    return flex


flex_compiled = _make(True)
flex_eager = _make(False)
