"""kvsparse's paged-attention conformance suite, for any implementation.

The suite is data: `kvsparse conformance --export DIR` writes the cases (safetensors + manifest.json, float64
reference output and LSE, tolerances by dtype; docs/conformance.md). This package runs a Python callable
over those files:

    from kvsparse.conformance import run, Unsupported

    def my_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap):
        # q [tokens, q_heads, head_dim]; k_cache, v_cache [blocks, block_size, kv_heads, head_dim] (strided
        # views of one storage); block_table [seqs, max_blocks] int32 (columns past a sequence hold stale ids
        # or -1); seq_lens [seqs] and query_start_loc [seqs + 1] int32; window 0 = off; softcap 0 = off.
        # Query row i of a sequence with q_len rows sits at position seq_len - q_len + i (causal).
        ...
        return out, lse          # lse [tokens, q_heads] natural log, or None

    report = run(my_attention, "DIR", device="cuda")   # prints one line per case, returns a Report

Raise `Unsupported("why")` (or NotImplementedError) for a case your kernel does not serve: it is reported as
unsupported, not failed. Failing cases come with a diagnosis (reads of unwritten slots, window or causal
conventions, tolerance). Ready adapters: `kvsparse.conformance.adapters` (vLLM's CPU kernel, PyTorch SDPA and
flex_attention, FlashInfer's paged decode, kvsparse). Command line: `python -m kvsparse.conformance --help`.

Importing this package needs only torch (not the kvsparse binding)."""
from .cases import Case, Suite, read_safetensors, write_safetensors
from .runner import Outcome, Report, Unsupported, run

__all__ = ["run", "Unsupported", "Suite", "Case", "Report", "Outcome", "read_safetensors", "write_safetensors"]
