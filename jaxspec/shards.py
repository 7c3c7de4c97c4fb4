"""The safetensors files of a Hugging Face checkpoint: their headers, and tensors read one at a time.

A checkpoint directory holds `model.safetensors`, or shards listed by `model.safetensors.index.json`
(`{"weight_map": {tensor name: file name}}`). A safetensors file is an 8-byte little-endian header
length, a JSON header `{name: {"dtype", "shape", "data_offsets": [begin, end]}}` and the raw bytes.
Headers are read eagerly (they are small); a tensor's bytes are read only when `read` asks for
them, into a buffer of its own, so nothing but the tensor being converted is in host memory. Reader and writer are ours
rather than the `safetensors` package's numpy backend, which has no bfloat16 or float8 dtypes;
`ml_dtypes` (a JAX dependency) supplies them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype name -> numpy dtype (all little-endian, as the format requires).
DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16, "I32": np.int32,
    "U32": np.uint32, "I64": np.int64, "U64": np.uint64, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,  # DeepSeek-V4's power-of-two scales
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype name, shape and absolute byte range."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def describe(self) -> str:
        return f"{list(self.shape)} {self.dtype}"


def read_header(path: str) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, by name. Raises ValueError on a malformed file."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        size = os.fstat(f.fileno()).st_size
        if header_len > size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {header_len} > file size {size})")
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        info = TensorInfo(path, entry["dtype"], tuple(entry["shape"]), data_start + begin, data_start + end)
        if info.end > size:
            raise ValueError(f"{path}: tensor {name} ends at byte {info.end}, past the end of the file ({size})")
        tensors[name] = info
    return tensors


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint directory, in shard order. Raises ValueError if none."""
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            raise ValueError(f"{index_path} lists shard(s) that are not in the directory: {missing[:5]}")
        return [os.path.join(directory, n) for n in names]
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}; not a Hugging Face safetensors checkpoint")


def read_headers(directory: str) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint, by name, from the shard headers (no tensor data is read).

    With an index, each tensor must be in the shard the index names, and every indexed tensor must
    exist: a stale index is an error, not a silently different model.
    """
    tensors: dict[str, TensorInfo] = {}
    for path in checkpoint_files(directory):
        for name, info in read_header(path).items():
            if name in tensors:
                raise ValueError(f"tensor {name} is in both {tensors[name].file} and {path}")
            tensors[name] = info
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        wrong = [n for n, file in weight_map.items()
                 if n not in tensors or os.path.basename(tensors[n].file) != file]
        if wrong:
            raise ValueError(f"{index_path} does not match the shards for {len(wrong)} tensor(s), e.g. {wrong[:5]}")
    return tensors


def read(info: TensorInfo) -> np.ndarray:
    """The tensor, read into a new array.

    Not memory-mapped: `jax.device_put` aliases a read-only mapping on CPU, and a parameter must
    not change (or fault) when its checkpoint file is later rewritten.
    """
    if info.dtype not in DTYPES:
        raise ValueError(f"{info.file}: safetensors dtype {info.dtype} is not supported")
    dtype = np.dtype(DTYPES[info.dtype])
    count = int(np.prod(info.shape, dtype=np.int64))
    if count * dtype.itemsize != info.nbytes:
        raise ValueError(f"{info.file}: a {info.describe()} tensor needs {count * dtype.itemsize} bytes, "
                         f"the header gives {info.nbytes}")
    if count == 0:
        return np.zeros(info.shape, dtype)
    with open(info.file, "rb") as f:
        f.seek(info.start)
        raw = np.fromfile(f, dtype=np.uint8, count=info.nbytes)
    if raw.size != info.nbytes:
        raise ValueError(f"{info.file}: truncated, {info.nbytes} bytes expected at offset {info.start}")
    return raw.view(dtype).reshape(info.shape)


def write(path: str | os.PathLike, tensors: dict[str, np.ndarray]) -> None:
    """Write `tensors` (any dtype in DTYPES, bfloat16 and float8 included) as one safetensors file."""
    names = {np.dtype(dtype): name for name, dtype in DTYPES.items()}
    header, offset = {}, 0
    for name, array in tensors.items():
        if array.dtype not in names:
            raise ValueError(f"tensor {name}: dtype {array.dtype} has no safetensors name")
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())
