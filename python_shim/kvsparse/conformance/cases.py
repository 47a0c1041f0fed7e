"""Reading an exported suite (`kvsparse conformance --export DIR`) into torch tensors, and writing outputs in
the suite's results format. Needs only torch (the safetensors format is read and written here directly)."""
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT, VERSIONS = "kvsparse-conformance", (1, 2)
_DT = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
       "I32": torch.int32, "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_ST = {v: k for k, v in _DT.items()}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_safetensors(path, device="cpu"):
    """{name: tensor} of a safetensors file, on `device`."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = _DT[info["dtype"]]
        t = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=torch.uint8).view(dt) if b > a else torch.empty(0, dtype=dt)
        out[name] = t.reshape(info["shape"]).to(device)
    return out


def write_safetensors(path, tensors):
    """Writes {name: tensor} (moved to the CPU, made contiguous) as a safetensors file."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        b = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@dataclass
class Case:
    """One case: its manifest entry, and its tensors on a device (views built as the manifest says)."""
    meta: dict
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    ref_out: torch.Tensor  # float64, on the CPU
    ref_lse: torch.Tensor
    storages: dict = field(repr=False, default_factory=dict)

    @property
    def name(self):
        return self.meta["name"]

    @property
    def dtype(self):
        return DTYPES[self.meta["dtype"]]

    @property
    def scale(self):
        return float(self.meta["scale"])

    @property
    def window(self):
        return int(self.meta["sliding_window"])

    @property
    def softcap(self):
        return float(self.meta["softcap"])

    @property
    def tolerance(self):
        return self.meta["tolerance"]

    @property
    def fp8(self):
        """The cache's FP8 format name (`float8_e4m3fn`, `float8_e5m2`) or None."""
        return self.meta.get("cache_dtype")

    def dequantized(self, dtype):
        """An FP8 case's (k_cache, v_cache) as values: float32(code value * scale), then `dtype`."""
        ks, vs = (torch.tensor(float(self.meta[k]), dtype=torch.float32, device=self.k_cache.device) for k in ("k_scale", "v_scale"))
        return (self.k_cache.to(torch.float32) * ks).to(dtype), (self.v_cache.to(torch.float32) * vs).to(dtype)

    def args(self, fp8_cache=None, native=False):
        """The adapter's positional arguments. An FP8 case's caches come dequantized to the query dtype (what
        a user of a kernel without FP8 support does), or to `fp8_cache` (e.g. torch.float32: exact), or as
        the FP8 tensors themselves when `native`."""
        k, v = self.k_cache, self.v_cache
        if self.fp8 and not native:
            k, v = self.dequantized(fp8_cache or self.dtype)
        return (self.query, k, v, self.block_table, self.seq_lens, self.query_start_loc, self.scale, self.window, self.softcap)


def _view(storages, v):
    return torch.as_strided(storages[v["storage"]], v["shape"], v["strides"], v["offset"])


class Suite:
    """An exported suite: `Suite(dir).cases` are the manifest entries; `load(entry, device)` the tensors."""

    def __init__(self, root):
        self.root = Path(root)
        self.manifest = json.loads((self.root / "manifest.json").read_text())
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") not in VERSIONS:
            raise ValueError(f"{self.root}: not a {FORMAT} export of a version in {VERSIONS}")
        self.cases = self.manifest["cases"]

    def select(self, filters=()):
        """Entries whose name contains any of `filters` (all when empty)."""
        return [c for c in self.cases if not filters or any(f in c["name"] for f in filters)]

    def load(self, entry, device="cpu"):
        t = read_safetensors(self.root / entry["file"], device="cpu")
        st = {k: t[k].to(device) for k in ("query_storage", "kv_storage")}
        v = entry["views"]
        return Case(meta=entry, query=_view(st, v["query"]), k_cache=_view(st, v["k_cache"]),
                    v_cache=_view(st, v["v_cache"]), block_table=t["block_table"].to(device),
                    seq_lens=t["seq_lens"].to(device), query_start_loc=t["query_start_loc"].to(device),
                    ref_out=t["ref_out"], ref_lse=t["ref_lse"], storages=st)
