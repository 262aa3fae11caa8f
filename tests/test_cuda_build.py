"""What the CUDA build must guarantee on any machine, GPU or not: device code for every
target architecture, no host-synchronising call in the C++ and CUDA sources of the core and
of the bindings (a lint: it reads our code, not CUTLASS's, and the GPU tests' CUDA-graph
capture is the runtime check),
and a clear error (never a crash) when a CUDA call meets a machine without a device."""

import pathlib
import re
import struct

import numpy as np
import pytest
from claims_cuda import ClaimsCuda

import groupgemm
from groupgemm import _core

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ---- the fatbinary ---------------------------------------------------------------------

FATBIN_MAGIC = 0xBA55ED50
ARCH_SPECIFIC = 0x100000  # entry flag of an arch-specific ("a") target such as sm_90a


def elf_section(path, wanted):
    data = pathlib.Path(path).read_bytes()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx]
    for h in headers:
        start = names[4] + h[0]
        if data[start:data.index(b"\0", start)].decode() == wanted:
            return data[h[4]:h[4] + h[5]]
    return b""


def fatbin_images(section):
    """(kind, sm, arch_specific) of every image; kind 1 is PTX, 2 is a cubin."""
    images, pos = set(), 0
    while pos + 16 <= len(section):
        magic, _, header_size, size = struct.unpack_from("<IHHQ", section, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fat binaries are 8-byte aligned within the section
            continue
        entry, end = pos + header_size, pos + header_size + size
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", section, entry)
            (sm,) = struct.unpack_from("<I", section, entry + 28)
            (flags,) = struct.unpack_from("<Q", section, entry + 40)
            images.add((kind, sm, bool(flags & ARCH_SPECIFIC)))
            entry += entry_header + payload
        pos = end
    return images


def compiled_architectures():
    """(sm, arch_specific) of each CMAKE_CUDA_ARCHITECTURES entry, e.g. '90a' -> (90, True)."""
    archs = []
    for entry in _core.cuda_architectures().split(","):
        number = entry.split("-")[0]  # '80-real' and '80-virtual' name the same sm
        archs.append((int(number.rstrip("a")), number.endswith("a")))
    return archs


CORE_LIBRARY = pathlib.Path(_core.__file__).with_name("libgroupgemm_core.so")  # the device code's home


@pytest.mark.skipif(not groupgemm.cuda_compiled(), reason="built without nvcc: no device code to inspect")
def test_fatbinary_holds_a_cubin_for_every_compiled_architecture_and_ptx_for_newer_gpus():
    images = fatbin_images(elf_section(CORE_LIBRARY, ".nv_fatbin"))
    cubins = {(sm, specific) for kind, sm, specific in images if kind == 2}
    ptx = {(sm, specific) for kind, sm, specific in images if kind == 1}
    archs = compiled_architectures()
    # The default build (CI's and the wheels') is 80,90a-real: sm_80 and sm_90a cubins, and
    # sm_80 PTX, which the driver compiles on GPUs newer than both (sm_100, sm_120).
    assert archs and all(arch in cubins for arch in archs), (archs, images)
    assert _core.cuda_architectures() != "80,90a-real" or ptx == {(80, False)}, images


def test_the_python_module_holds_no_device_code():
    # The CUDA code is the core library's alone: a module per CPython links it, compiled once.
    assert elf_section(_core.__file__, ".nv_fatbin") == b""


# ---- no host synchronisation in the core and the bindings -----------------------------

HOST_SYNC = re.compile(
    r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaStreamQuery|cudaEventQuery"
    r"|cudaMemcpy\s*\(|cudaMemcpyDeviceToHost|cudaMemcpyDefault|cudaMalloc|cudaFree|cudaHostAlloc"
    r"|thrust::|\.synchronize\(")


def host_sync_calls(text):
    return [m.group(0) for m in HOST_SYNC.finditer(text)]


def test_scanner_flags_host_synchronising_calls():
    assert host_sync_calls("cudaStreamSynchronize(s); cudaMemcpy (d, h, n, k);") == [
        "cudaStreamSynchronize", "cudaMemcpy ("]
    assert host_sync_calls("cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s);") == ["cudaMemcpyDeviceToHost"]
    assert host_sync_calls("cudaMallocAsync(&p, n, s); cudaEventSynchronize(e);") == [
        "cudaMalloc", "cudaEventSynchronize"]
    assert host_sync_calls("kernel<<<1, 256, 0, stream>>>(args); cudaGetLastError();") == []


# Every directory of our C++ and CUDA code: the core and the bindings that call it.
LINTED = ("core_cuda", "torch_ext/csrc", "jax_ext/csrc", "python/csrc")


def linted_sources(root):
    return [p for d in LINTED if (root / d).is_dir() for p in (root / d).rglob("*")
            if p.suffix in {".cu", ".cuh", ".h", ".cpp"} or p.name.endswith(".cu.in")]  # CMake's templates too


def host_sync_findings(root):
    """{source relative to root: its host-synchronising calls}, for sources with any."""
    found = {str(p.relative_to(root)): host_sync_calls(p.read_text()) for p in linted_sources(root)}
    return {p: calls for p, calls in found.items() if calls}


def test_core_and_bindings_have_no_host_synchronising_call():
    sources = {str(p.relative_to(ROOT)).split("/")[0] for p in linted_sources(ROOT)}
    assert sources == {"core_cuda", "torch_ext", "jax_ext", "python"}
    assert any(p.suffix == ".cu" for p in linted_sources(ROOT))
    assert host_sync_findings(ROOT) == {}


@pytest.mark.parametrize("binding", ["torch_ext/csrc/array_bindings.cpp", "jax_ext/csrc/ffi_handlers.cpp",
                                     "python/csrc/module.cpp"])
def test_the_lint_finds_a_sync_call_planted_in_a_binding_file(tmp_path, binding):
    planted = tmp_path / binding
    planted.parent.mkdir(parents=True)
    planted.write_text((ROOT / binding).read_text() + "\nvoid wait(cudaStream_t s) { cudaStreamSynchronize(s); }\n")
    assert host_sync_findings(tmp_path) == {binding: ["cudaStreamSynchronize"]}


# ---- a CUDA call without a usable device ----------------------------------------------



def test_cuda_call_without_a_device_raises_clearly():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a real device would be handed host pointers")
    lhs, out = np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)
    rhs, sizes = np.zeros((2, 8, 8), np.float32), np.array([2, 2], np.int32)
    workspace = np.zeros(_core.workspace_bytes(_core.Device.cuda, 2), np.uint8)
    expected = "no usable CUDA device" if groupgemm.cuda_compiled() else "built without CUDA"
    with pytest.raises((RuntimeError, ValueError), match=expected):
        _core.grouped_matmul(*map(ClaimsCuda, (lhs, rhs, sizes)), out=ClaimsCuda(out), workspace=ClaimsCuda(workspace))
    with pytest.raises((RuntimeError, ValueError), match=expected):
        _core.grouped_bias_grad(ClaimsCuda(out), ClaimsCuda(sizes), out=ClaimsCuda(np.zeros((2, 8), np.float32)),
                                workspace=ClaimsCuda(workspace))
    if groupgemm.cuda_compiled():
        with pytest.raises(ValueError, match="workspace has 0 bytes"):
            _core.grouped_matmul(*map(ClaimsCuda, (lhs, rhs, sizes)), out=ClaimsCuda(out))


def test_fp8_cuda_call_without_a_device_raises_clearly():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a real device would be handed host pointers")
    lhs, rhs = np.zeros((4, 16), np.uint8), np.zeros((2, 16, 16), np.uint8)  # float8 bytes
    lhs_scale, rhs_scale = np.ones(4, np.float32), np.ones((2, 16), np.float32)
    sizes, out = np.array([2, 2], np.int32), np.zeros((4, 16), np.float32)
    rowwise, e4m3 = _core.Fp8Scaling.rowwise, _core.Fp8Type.e4m3
    nbytes = _core.fp8_workspace_bytes(_core.Device.cuda, _core.Fp8Call.matmul, rowwise, 2, 4, 16, 16)
    expected = "no usable CUDA device" if groupgemm.cuda_compiled() else "built without CUDA"
    with pytest.raises((RuntimeError, ValueError), match=expected):
        _core.scaled_grouped_matmul(*map(ClaimsCuda, (lhs, rhs, lhs_scale, rhs_scale, sizes)), out=ClaimsCuda(out),
                                    workspace=ClaimsCuda(np.zeros(nbytes, np.uint8)), scaling=rowwise,
                                    lhs_type=e4m3, rhs_type=e4m3)
    with pytest.raises((RuntimeError, ValueError), match=expected):
        _core.fp8_quantize_rows(*map(ClaimsCuda, (out, lhs, lhs_scale)), scaling=rowwise, out_type=e4m3)
