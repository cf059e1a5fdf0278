"""An analytic cost database: FLOPs and bytes of each layer against a device's datasheet.

Glossary
--------
device spec
    A :class:`DeviceSpec`: peak dense half-precision FLOP/s, HBM bandwidth and size, devices per
    node and the two links, with the fractions of peak a real kernel reaches.
op
    One kernel of a layer's forward: ``(flops, bytes)``, bytes read plus written in HBM.
    FLOPs count matrix multiplies only (Kaplan et al. 2020; Narayanan et al. 2021, the Megatron
    convention); layernorm, softmax, activations, adds, gathers and concats are priced by bytes.

Time of a forward op (roofline, Williams et al., CACM 2009)::

    t_op = kernel_launch_s + max(flops / (peak_flops * achievable_fraction),
                                 bytes / (hbm_bytes_per_s * hbm_fraction))

``fwd_s`` is the sum over the layer's ops; ``bwd_s = 2 * fwd_s`` (each matmul's backward is two
matmuls of its size; each elementwise op's backward reads about twice what it did). There is
no separate small-batch efficiency ramp: at small micro-batches a GEMM's weight bytes dominate
and the roofline turns it memory-bound, and the launch floor bounds tiny kernels. A transformer
layer's forward matmul FLOPs are ``24 b s h^2 + 4 b s^2 h`` when ``ffn = 4h`` (Narayanan et
al. 2021, Sec. 5.1).

Precision is mixed, as in the paper's era (V100 fp16 with fp32 master weights): parameters,
activations and gradients take ``bytes_per_element = 2`` bytes; Adam keeps an fp32 master copy
and two fp32 moments, so weight state is 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter (ZeRO,
Rajbhandari et al. 2020, Sec. 3.1), i.e. ``optimizer_factor = 7`` times the parameter bytes on
top of them. With ``bytes_per_element = 4`` (plain fp32 Adam) the factor is 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..planner.costs import CommFit, CostDB, Hardware, LayerCost
from .desc import LayerDesc, ModelDesc, output_elements, param_count

__all__ = ["DeviceSpec", "V100_SUMMIT", "A100_80GB", "H100_80GB", "DEVICES", "optimizer_factor", "layer_ops",
           "layer_flops", "layer_stash_bytes", "layer_times", "analytic_costs", "DEFAULT_MICRO_BATCHES"]

DEFAULT_MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_INDEX_BYTES = 8  # int64 embedding indices


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator and its links, from datasheets; rates in FLOP/s and bytes/s."""

    name: str
    peak_flops: float           # dense fp16/bf16 tensor-core peak
    hbm_bytes_per_s: float
    memory_bytes: int
    devices_per_node: int
    intra_bytes_per_s: float    # device-to-device inside a node, one direction
    intra_latency_s: float
    inter_bytes_per_s: float    # per device between nodes, one direction
    inter_latency_s: float
    bytes_per_element: int = 2  # fp16/bf16 activations, parameters and gradients
    # Assumptions, the same for every preset and fitted to nothing in this repository: a large
    # fp16 GEMM reaches ~90% of peak (V100 PCIe, 8192^3 cuBLAS: ~101 of 112 TFLOPS, NVIDIA
    # developer forum thread 79781), a training layer's smaller GEMMs less; copies reach
    # ~80-85% of HBM peak (V100: ~750 of 900 GB/s, Jia et al. arXiv 1804.06826).
    achievable_fraction: float = 0.7
    hbm_fraction: float = 0.8
    kernel_launch_s: float = 5e-6  # typical CUDA launch overhead; an assumption


def optimizer_factor(bytes_per_element: int) -> float:
    """Gradient and Adam state bytes per parameter byte (see the module docstring).

    >>> optimizer_factor(2), optimizer_factor(4)
    (7.0, 3.0)
    """
    return 7.0 if bytes_per_element == 2 else 3.0


# Latencies (5 us in a node, 10 us across) are the order of NCCL's small-message point-to-point
# latency; assumptions, not datasheet figures.
V100_SUMMIT = DeviceSpec(
    name="V100-SXM2-16GB (Summit)",
    peak_flops=125e12,            # NVIDIA Tesla V100 datasheet, SXM2: 125 TFLOPS tensor
    hbm_bytes_per_s=900e9,        # same datasheet: HBM2 900 GB/s
    memory_bytes=16 * 2**30,      # 16 GB HBM2 (Summit's V100s)
    devices_per_node=4,           # GraphPipe Sec. 7.1 (Summit nodes physically hold 6)
    intra_bytes_per_s=50e9,       # OLCF Summit user guide: NVLink 2.0, 50 GB/s GPU-GPU per direction
    intra_latency_s=5e-6,
    inter_bytes_per_s=12.5e9,     # GraphPipe Sec. 7.1: Mellanox EDR 100 Gb/s InfiniBand
    inter_latency_s=10e-6,
)
A100_80GB = DeviceSpec(
    name="A100-SXM4-80GB (DGX A100)",
    peak_flops=312e12,            # NVIDIA A100 datasheet: 312 TFLOPS bf16/fp16 dense
    hbm_bytes_per_s=2039e9,       # same datasheet, 80GB SXM: HBM2e 2,039 GB/s
    memory_bytes=80 * 2**30,
    devices_per_node=8,           # DGX A100
    intra_bytes_per_s=300e9,      # NVLink 3: 600 GB/s per GPU both directions together
    intra_latency_s=5e-6,
    inter_bytes_per_s=25e9,       # DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU
    inter_latency_s=10e-6,
)
H100_80GB = DeviceSpec(
    name="H100-SXM5-80GB (DGX H100)",
    peak_flops=989e12,            # NVIDIA H100 datasheet, SXM: 989 TFLOPS bf16 dense (1,979 sparse)
    hbm_bytes_per_s=3.35e12,      # same datasheet: HBM3 3.35 TB/s
    memory_bytes=80 * 2**30,
    devices_per_node=8,           # DGX H100
    intra_bytes_per_s=450e9,      # NVLink 4: 900 GB/s per GPU both directions together
    intra_latency_s=5e-6,
    inter_bytes_per_s=50e9,       # DGX H100: one 400 Gb/s NDR InfiniBand NIC per GPU
    inter_latency_s=10e-6,
)
DEVICES = {"v100": V100_SUMMIT, "a100": A100_80GB, "h100": H100_80GB}


def _gemm(m: float, k: float, n: float, eb: int, batch: float = 1) -> tuple[float, float]:
    """``batch`` products of ``[m, k] @ [k, n]``: FLOPs and bytes read and written."""
    return 2 * m * k * n * batch, (m * k + k * n + m * n) * eb * batch


def _attention_ops(b: int, d, eb: int) -> list[tuple[float, float]]:
    s, h, a = d["seq"], d["hidden"], d["heads"]
    t, dh = b * s, h // a
    return [_gemm(t, h, 3 * h, eb),                 # Q, K, V projections
            _gemm(s, dh, s, eb, b * a),             # scores Q K^T per head
            (0.0, 2 * b * a * s * s * eb),          # softmax
            _gemm(s, s, dh, eb, b * a),             # scores @ V
            _gemm(t, h, h, eb),                     # output projection
            (0.0, 3 * t * h * eb)]                  # residual add


def _mlp_ops(b: int, d, eb: int) -> list[tuple[float, float]]:
    t, h, f = b * d["seq"], d["hidden"], d["ffn"]
    return [_gemm(t, h, f, eb), (0.0, 2 * t * f * eb), _gemm(t, f, h, eb), (0.0, 3 * t * h * eb)]


def layer_ops(layer: LayerDesc, micro_batch: int, *, bytes_per_element: int = 2) -> list[tuple[float, float]]:
    """The forward kernels of ``layer`` on ``micro_batch`` samples, as ``(flops, bytes)``."""
    b, d, eb = micro_batch, layer.dims, bytes_per_element
    kind = layer.kind
    if kind == "linear":
        ops = [_gemm(b, d["in"], d["out"], eb)]
        return ops + ([(0.0, 2 * b * d["out"] * eb)] if d["activation"] != "none" else [])
    if kind == "embedding_bag":
        rows_read = b * d["bag"]   # gather: read indices and rows, write them side by side
        return [(0.0, rows_read * (_INDEX_BYTES + 2 * d["dim"] * eb))]
    if kind == "layernorm":
        return [(0.0, 2 * b * d["seq"] * d["hidden"] * eb)]
    if kind == "attention":
        return _attention_ops(b, d, eb)
    if kind == "mlp":
        return _mlp_ops(b, d, eb)
    if kind == "transformer":
        norm = (0.0, 2 * b * d["seq"] * d["hidden"] * eb)
        return [norm, *_attention_ops(b, d, eb), norm, *_mlp_ops(b, d, eb)]
    if kind == "concat":
        return [(0.0, 2 * b * output_elements(layer) * eb)]
    # head: optional mean over the sequence, then the projection
    pool = [(0.0, b * (d["seq"] + 1) * d["in"] * eb)] if d["seq"] else []
    return pool + [_gemm(b, d["in"], d["out"], eb)]


def layer_flops(layer: LayerDesc, micro_batch: int) -> float:
    """Forward matmul FLOPs of ``layer`` on ``micro_batch`` samples (backward: twice this).

    >>> layer_flops(LayerDesc("fc", "linear", ("x",), {"in": 3, "out": 5, "activation": "relu"}), 2)
    60.0
    """
    return float(sum(f for f, _ in layer_ops(layer, micro_batch)))


def layer_stash_bytes(layer: LayerDesc, *, bytes_per_element: int = 2) -> float:
    """Activation bytes per sample the backward of ``layer`` needs kept.

    Transformer parts follow Korthikanti et al. 2022 (arXiv 2205.05198), Sec. 4.1, Eq. 1, for
    16-bit activations with dropout masks: per token ``34 h + 5 a s`` bytes per layer, split as
    ``11 h + 5 a s`` (attention), ``19 h`` (MLP) and ``2 h`` per layernorm; scaled by
    ``bytes_per_element / 2`` otherwise. A linear layer keeps its input (for the weight
    gradient) and, with ReLU, its pre-activation; an embedding bag its indices; the head its
    pooled input and logits; a concat nothing.
    """
    d, eb = layer.dims, bytes_per_element
    half = eb / 2
    kind = layer.kind
    if kind == "linear":
        return (d["in"] + (d["out"] if d["activation"] != "none" else 0)) * eb
    if kind == "embedding_bag":
        return float(d["bag"] * _INDEX_BYTES)
    if kind == "head":
        return (d["in"] + d["out"]) * eb
    if kind == "concat":
        return 0.0
    s, h = d["seq"], d["hidden"]
    if kind == "layernorm":
        return 2 * s * h * half
    if kind == "attention":
        return (11 * s * h + 5 * d["heads"] * s * s) * half
    if kind == "mlp":
        return 19 * s * h * half
    return (34 * s * h + 5 * d["heads"] * s * s) * half  # transformer


def layer_times(layer: LayerDesc, device: DeviceSpec, micro_batch: int) -> tuple[float, float]:
    """Forward and backward seconds of ``layer`` on ``micro_batch`` samples (module docstring)."""
    compute = device.peak_flops * device.achievable_fraction
    memory = device.hbm_bytes_per_s * device.hbm_fraction
    fwd = sum(device.kernel_launch_s + max(f / compute, nbytes / memory)
              for f, nbytes in layer_ops(layer, micro_batch, bytes_per_element=device.bytes_per_element))
    return fwd, 2 * fwd


def analytic_costs(model: ModelDesc, device: DeviceSpec, *,
                   micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES) -> CostDB:
    """Price every layer of ``model`` on ``device`` at each micro-batch size: a :class:`CostDB`.

    >>> from gpp_deepspeed.models import tiny
    >>> db = analytic_costs(tiny("dlrm"), V100_SUMMIT, micro_batches=(1, 2))
    >>> db.source, db.hardware.optimizer_factor
    ('analytic: V100-SXM2-16GB (Summit) (FLOPs x efficiency; not measured)', 7.0)
    """
    mbs = tuple(sorted(set(int(b) for b in micro_batches)))
    eb = device.bytes_per_element
    layers = []
    for layer in model.layers:
        times = [layer_times(layer, device, b) for b in mbs]
        layers.append(LayerCost(name=layer.name, inputs=tuple(layer.inputs), micro_batches=mbs,
                                fwd_s=tuple(f for f, _ in times), bwd_s=tuple(b for _, b in times),
                                param_bytes=param_count(layer) * eb, out_bytes=output_elements(layer) * eb,
                                stash_bytes=int(round(layer_stash_bytes(layer, bytes_per_element=eb)))))
    hardware = Hardware(name=device.name, memory_bytes=device.memory_bytes, devices_per_node=device.devices_per_node,
                        intra=CommFit(alpha_s=device.intra_latency_s, beta_s_per_byte=1 / device.intra_bytes_per_s),
                        inter=CommFit(alpha_s=device.inter_latency_s, beta_s_per_byte=1 / device.inter_bytes_per_s),
                        optimizer_factor=optimizer_factor(eb))
    return CostDB(model=model.name, source=f"analytic: {device.name} (FLOPs x efficiency; not measured)",
                  input_names=tuple(model.input_names), output=model.output, layers=tuple(layers),
                  hardware=hardware, granularity=model.granularity)
