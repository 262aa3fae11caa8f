"""Static evidence about the CUDA GEMM kernels, from the core library's sm_90a cubin: the
CUTLASS 3.x grouped GEMMs (every tile, the bias epilogue included) run on WGMMA (HGMMA
instructions), the FP8 ones on FP8 WGMMA (QGMMA), the CUTLASS 2.x ones on tensor-core MMA
(HMMA), and no kernel spills registers to local memory (STL/LDL); the fused expert MLP's
kernels (its gathered grouped GEMMs on HMMA) in the sm_80 cubin as well, and its sm_90a
gathered GEMM (cp.async into WGMMA).
No GPU is needed: cuobjdump (the nvidia-cuda-cuobjdump wheel, with nvdisasm from
nvidia-cuda-nvdisasm; ./dev.sh setup installs both) disassembles the shipped code."""

import collections
import functools
import importlib.metadata
import os
import re
import shutil
import subprocess

import kernel_table
import pytest

import groupgemm
from groupgemm import _core

pytestmark = pytest.mark.skipif(not groupgemm.cuda_compiled(), reason="built without nvcc: no device code")

TOOLS = "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (./dev.sh setup does)"


def wheel_tool(dist, name):
    """The executable `name` from the installed wheel `dist`, else from PATH or the toolkit."""
    try:
        for f in importlib.metadata.distribution(dist).files or ():
            if str(f).endswith("bin/" + name):
                return os.path.realpath(importlib.metadata.distribution(dist).locate_file(f))
    except importlib.metadata.PackageNotFoundError:
        pass
    return shutil.which(name) or shutil.which(name, path="/usr/local/cuda/bin")


@functools.cache
def cubin_kernels(arch):
    """{mangled kernel name: SASS text} of the core library's cubin for `arch` (sm_80, sm_90a)."""
    cuobjdump = wheel_tool("nvidia-cuda-cuobjdump", "cuobjdump")
    nvdisasm = wheel_tool("nvidia-cuda-nvdisasm", "nvdisasm")
    assert cuobjdump and nvdisasm, "cuobjdump and nvdisasm are needed: " + TOOLS
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    core = os.path.join(os.path.dirname(_core.__file__), "libgroupgemm_core.so")
    sass = subprocess.run([cuobjdump, "-sass", "-arch", arch, core], env=env, check=True,
                          capture_output=True, text=True).stdout
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def sm90a_kernels():
    return cubin_kernels("sm_90a")


def instructions(sass, opcode):
    return re.findall(rf"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?{opcode}\b", sass, flags=re.M)


# The FP8 grouped GEMM (fp8_sm90.cuh): the blockwise-scaled FP8 mainloop over a GroupProblemShape.
def is_fp8_gemm(name):
    return "GroupProblemShape" in name and "MainloopSm90ArrayTmaGmmaWarpSpecializedBlockwise" in name


# CUTLASS 3.x pointer-array grouped GEMM (cutlass_sm90.cuh): GemmUniversal over a
# GroupProblemShape with the Hopper TMA + GMMA mainloop.
def is_sm90_gemm(name):
    return "GroupProblemShape" in name and "MainloopSm90ArrayTmaGmmaWarpSpecialized" in name and not is_fp8_gemm(name)


# CUTLASS 2.x GemmGrouped (cutlass_grouped.cuh); its 16-bit instances use tensor-core MMA,
# its float32 instance (exact fp32, no TF32) CUDA-core FMA.
def is_sm80_gemm(name):
    return "GemmGrouped" in name


def is_16bit(name):
    return "bfloat16_t" in name or "6half_t" in name


# Its tiles (the Hopper kernel table's): the kernel schedule, then the tile's M and N in the
# mangled name.
SM90_TILE = re.compile(r"KernelPtrArrayTmaWarpSpecialized(Cooperative|Pingpong)EEE\w*?ILi(\d+)EEE\w*?ILi(\d+)EEE")
SM90_TILES = {(t.schedule.capitalize(), t.shape[0], t.shape[1]) for t in kernel_table.read().tiles}


def sm90_tile(name):
    schedule, m, n = SM90_TILE.search(name).groups()
    return schedule, int(m), int(n)


def has_bias_epilogue(name):
    """The forward's bias as a per-group broadcast row in the epilogue (cutlass_sm90.cuh)."""
    return "Sm90RowBroadcast" in name


def test_sm90a_cubin_holds_the_gemm_kernels():
    names = list(sm90a_kernels())
    # Per sm90 tile: bfloat16 and float16 inputs x (same-dtype, float32) outputs x three
    # layouts, and the bias epilogue of both forward layouts (same-dtype output); for the
    # 2.x family the first twelve.
    sm90 = [n for n in names if is_sm90_gemm(n)]
    per_tile = collections.Counter((sm90_tile(n), has_bias_epilogue(n)) for n in sm90)
    assert per_tile == {(tile, bias): 4 if bias else 12 for tile in SM90_TILES for bias in (False, True)}, per_tile
    assert sum(is_sm80_gemm(n) and is_16bit(n) for n in names) == 12, names


def test_sm90a_cubin_holds_the_fp8_gemm_kernels():
    # float8_e4m3fn and float8_e5m2 A (a gradient) x bfloat16 and float32 outputs; B is e4m3.
    fp8 = [n for n in sm90a_kernels() if is_fp8_gemm(n)]
    assert len(fp8) == 4, fp8
    assert sum("float_e5m2_t" in n for n in fp8) == 2 and all("float_e4m3_t" in n for n in fp8), fp8


def test_fp8_gemm_kernels_use_fp8_wgmma():
    kernels = {n: s for n, s in sm90a_kernels().items() if is_fp8_gemm(n)}
    assert kernels
    fp8_wgmma = r"QGMMA\.\w+\.F32\.E[45]M[23]\.E4M3"  # float32 accumulation, e4m3 or e5m2 A, e4m3 B
    assert [n for n, s in kernels.items() if not instructions(s, fp8_wgmma)] == []
    assert [n for n, s in kernels.items() if instructions(s, "HGMMA")] == []


def test_sm90_gemm_kernels_use_wgmma():
    kernels = {n: s for n, s in sm90a_kernels().items() if is_sm90_gemm(n)}
    assert kernels
    assert {n: len(instructions(s, "HGMMA")) for n, s in kernels.items() if not instructions(s, "HGMMA")} == {}


def test_sm80_gemm_kernels_use_tensor_core_mma():
    kernels = {n: s for n, s in sm90a_kernels().items() if is_sm80_gemm(n) and is_16bit(n)}
    assert kernels
    assert [n for n, s in kernels.items() if not instructions(s, "HMMA")] == []
    assert [n for n, s in kernels.items() if instructions(s, "HGMMA")] == []


def test_no_kernel_spills_to_local_memory():
    kernels = sm90a_kernels()
    spills = {n: len(instructions(s, "STL") + instructions(s, "LDL")) for n, s in kernels.items()}
    assert any(map(is_sm90_gemm, kernels)) and any(map(is_fp8_gemm, kernels))
    assert {n: c for n, c in spills.items() if c} == {}


# The fused expert MLP (core_cuda/cuda/expert_mlp*.cu, gathered_gemm*.cu): the gathered
# grouped GEMMs (cutlass_gathered.cuh: CUTLASS 2.x's mainloop with a gathered operand, one
# instance per input dtype, output dtype, layout and gathered operand) and its small kernels,
# in the sm_80 cubin (every GPU but Hopper runs it, or its PTX) and the sm_90a one.
def is_gathered_gemm(name):
    return "GatheredGroupedGemm" in name and not is_gathered_sm90_gemm(name)


# The sm_90a gathered GEMM (cutlass_gathered_sm90.cuh): A's rows, or a weight gradient's
# contraction, gathered by cp.async (LDGSTS) into WGMMA, in the sm_90a cubin only.
def is_gathered_sm90_gemm(name):
    return "GatheredGroupedGemmSm90" in name


EXPERT_MLP_KERNELS = ("expert_setup_kernel", "fill_rows_kernel", "slot_h_kernel", "activation_rows_kernel",
                      "backward_rows_kernel", "expert_sums_kernel", "zero_idle_kernel", "gathered_unaligned_kernel")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_fused_expert_mlp_kernels_are_compiled_and_never_spill(arch):
    kernels = cubin_kernels(arch)
    gathered = [n for n in kernels if is_gathered_gemm(n)]
    # bfloat16 and float16: A's rows gathered in 2 layouts x 2 output dtypes, a weight
    # gradient's contraction gathered in A or in B; float32: 2 + 2 (one output dtype).
    assert sum(map(is_16bit, gathered)) == 12 and len(gathered) == 16, gathered
    ours = {n: s for n, s in kernels.items() if is_gathered_gemm(n) or any(k in n for k in EXPERT_MLP_KERNELS)}
    assert {k for k in EXPERT_MLP_KERNELS if not any(k in n for n in ours)} == set()
    spills = {n: len(instructions(s, "STL") + instructions(s, "LDL")) for n, s in ours.items()}
    assert {n: c for n, c in spills.items() if c} == {}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_gathered_gemm_kernels_use_tensor_core_mma(arch):
    kernels = {n: s for n, s in cubin_kernels(arch).items() if is_gathered_gemm(n) and is_16bit(n)}
    assert kernels
    assert [n for n, s in kernels.items() if not instructions(s, "HMMA")] == []


def test_sm90a_gathered_gemm_kernels_load_with_cp_async_into_wgmma():
    # bfloat16 and float16 x (2 forward layouts x 2 output dtypes + the contraction gathered
    # in A or in B).
    kernels = {n: s for n, s in sm90a_kernels().items() if is_gathered_sm90_gemm(n)}
    assert len(kernels) == 12 and sum("6half_t" in n for n in kernels) == 6, list(kernels)
    assert [n for n, s in kernels.items() if not (instructions(s, "HGMMA") and instructions(s, "LDGSTS"))] == []
    assert not any(map(is_gathered_sm90_gemm, cubin_kernels("sm_80")))
