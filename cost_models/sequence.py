"""Communication of sequence parallelism's mixers: what one rank sends for one op that mixes
positions (attention, a short causal convolution's halo, a long convolution's channel
all-to-alls, a cumsum's prefix, the selective scan's states, a flip along the sequence), in bytes
and in seconds, from its shapes, its dtype's item size,
the sequence group's size and a frozen ``CommSpec``.

Pure: nothing here reads a graph. Each mixer's ``exchange_bytes`` returns these bytes, and
``choose_attention`` in passes/sequence/mixer_attention.py compares them for
``sequence_parallel.attention: "auto"`` (NOTE [Sequence mixers] in passes/sequence/sequence_mixers.py);
the sends themselves are described in NOTE [Ring attention] and NOTE [Sequence parallelism as a
rewrite]. A new mixer's formulas go here beside attention's: its site's dimensions as a frozen
dataclass, and ``<strategy>_exchange_bytes`` and ``<strategy>_exchange_s`` for each strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerofx.cost_models.comm import CommSpec, estimate_all_to_all_s

FP32_BYTES = 4  # the ring's key/value gradient accumulators


@dataclass(frozen=True)
class AttentionDims:
    """One attention over the whole sequence: q (B, H, T, Dqk), k (B, Hkv, T, Dqk), v (B, Hkv, T, Dv)."""

    batch: int
    seq_len: int
    q_heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    itemsize: int


def _local_tokens(dims: AttentionDims, size: int) -> int:
    return dims.batch * (dims.seq_len // size)  # of one rank's slice


def _ulysses_kv_heads(dims: AttentionDims, size: int) -> int:
    """Key/value heads S does not divide are repeated to the query heads before the all-to-all."""
    return dims.kv_heads if dims.kv_heads % size == 0 else dims.q_heads


def ulysses_inputs_bytes(dims: AttentionDims, size: int) -> float:
    """One rank's q, k and v slices, the input of the forward's all-to-alls to head sharding."""
    return _local_tokens(dims, size) * dims.itemsize * (dims.q_heads * dims.qk_dim + _ulysses_kv_heads(dims, size) * (dims.qk_dim + dims.v_dim))


def ulysses_output_bytes(dims: AttentionDims, size: int) -> float:
    """One rank's share of the output, the input of the all-to-all back to sequence sharding."""
    return _local_tokens(dims, size) * dims.itemsize * dims.q_heads * dims.v_dim


def ulysses_exchange_bytes(dims: AttentionDims, size: int) -> float:
    """Bytes one rank sends for one attention's forward and backward under Ulysses: (S-1)/S of q,
    k, v and of the output in the forward, and as many gradients in the backward."""
    return 2 * (size - 1) / size * (ulysses_inputs_bytes(dims, size) + ulysses_output_bytes(dims, size))


def ring_block_bytes(dims: AttentionDims, size: int) -> float:
    """One rank's k and v block, as it travels the ring."""
    return _local_tokens(dims, size) * dims.kv_heads * (dims.qk_dim + dims.v_dim) * dims.itemsize


def ring_exchange_bytes(dims: AttentionDims, size: int) -> float:
    """Bytes one rank sends for one attention's forward and backward under ring attention: its k
    and v block S - 1 times in the forward, S - 1 times again in the backward, and their fp32
    gradients S times."""
    block = ring_block_bytes(dims, size)
    return 2 * (size - 1) * block + size * block / dims.itemsize * FP32_BYTES


def ulysses_exchange_s(dims: AttentionDims, size: int, spec: CommSpec) -> float:
    """Seconds of one attention's Ulysses all-to-alls, forward and backward: to heads and back in
    each direction (grouped-query attention's second all-to-all counted in the bytes, not as a launch)."""
    return 2 * (estimate_all_to_all_s(ulysses_inputs_bytes(dims, size), size, spec)
                + estimate_all_to_all_s(ulysses_output_bytes(dims, size), size, spec))


def ring_exchange_s(dims: AttentionDims, size: int, spec: CommSpec) -> float:
    """Seconds of one attention's ring sends, forward and backward, each to the neighbour over the
    slowest link the group crosses; not hidden behind the blocks' compute here (the schedule's
    overlap model does that, NOTE [The overlap model] in passes/analysis/analyze_schedule.py)."""
    alpha_s, bandwidth = spec.link(size)
    block = ring_block_bytes(dims, size)
    grads = block / dims.itemsize * FP32_BYTES
    return 2 * (size - 1) * (alpha_s + block / bandwidth) + size * (alpha_s + grads / bandwidth)


# --------------------------------------------------------------------------- convolutions and cumsum
@dataclass(frozen=True)
class HaloDims:
    """One causal convolution over the whole sequence: signal (B, C, T), K taps per channel;
    ``slice_len`` T/S positions a rank (None: K - 1 within it)."""

    batch: int
    channels: int
    kernel: int
    itemsize: int
    slice_len: int | None = None


def halo_input_bytes(dims: HaloDims, size: int) -> float:
    """One rank's all-to-all input: its last K - 1 positions, one copy for every rank of the
    group (the rank's place in it is not a graph constant, so every rank gets the tail and the
    right neighbour keeps it); its whole slice where K - 1 is longer (NOTE [A halo longer than a
    rank's slice] in passes/sequence/mixer_conv.py)."""
    width = dims.kernel - 1 if dims.slice_len is None else min(dims.kernel - 1, dims.slice_len)
    return size * dims.batch * dims.channels * width * dims.itemsize


def halo_exchange_bytes(dims: HaloDims, size: int) -> float:
    """Bytes one rank sends for one convolution's forward and backward: (S-1)/S of the
    all-to-all input each way (the halo forward, its gradient backward)."""
    return 2 * (size - 1) / size * halo_input_bytes(dims, size)


def halo_exchange_s(dims: HaloDims, size: int, spec: CommSpec) -> float:
    """Seconds of one convolution's halo all-to-alls, forward and backward."""
    return 2 * estimate_all_to_all_s(halo_input_bytes(dims, size), size, spec) if dims.kernel > 1 else 0.0


@dataclass(frozen=True)
class LongConvDims:
    """One FFT convolution over the whole sequence: signal (B, C, T), filter (C, T) by lag, both
    exchanged in the FFT's dtype (``itemsize``)."""

    batch: int
    channels: int
    seq_len: int
    itemsize: int


def channel_all_to_all_bytes(dims: LongConvDims, size: int) -> float:
    """One rank's slices as the three all-to-alls take them: the signal and the filter to channel
    shards before the FFTs, the output back to sequence shards after."""
    local = dims.seq_len // size
    return (2 * dims.batch + 1) * dims.channels * local * dims.itemsize


def channels_exchange_bytes(dims: LongConvDims, size: int) -> float:
    """Bytes one rank sends for one FFT convolution's forward and backward: (S-1)/S of each
    all-to-all's input, and as many gradients backward."""
    return 2 * (size - 1) / size * channel_all_to_all_bytes(dims, size)


def channels_exchange_s(dims: LongConvDims, size: int, spec: CommSpec) -> float:
    """Seconds of one FFT convolution's all-to-alls, forward and backward (the signal and the
    filter apart: two launches before, one after)."""
    local = dims.seq_len // size
    signal, filt = dims.batch * dims.channels * local * dims.itemsize, dims.channels * local * dims.itemsize
    return 2 * (2 * estimate_all_to_all_s(signal, size, spec) + estimate_all_to_all_s(filt, size, spec))


@dataclass(frozen=True)
class PrefixDims:
    """One cumsum along the sequence: ``rows`` running sums (the elements of one position), each
    total exchanged in the accumulation dtype (``itemsize``, fp32 at least for 16-bit floats)."""

    rows: int
    itemsize: int


def prefix_input_bytes(dims: PrefixDims, size: int) -> float:
    """One rank's all-to-all input: its slice's totals, one copy for every rank of the group."""
    return size * dims.rows * dims.itemsize


def prefix_exchange_bytes(dims: PrefixDims, size: int) -> float:
    """Bytes one rank sends for one cumsum's forward and backward: (S-1)/S of the totals' all-to-all
    input each way (the totals forward, their gradients backward)."""
    return 2 * (size - 1) / size * prefix_input_bytes(dims, size)


def prefix_exchange_s(dims: PrefixDims, size: int, spec: CommSpec) -> float:
    """Seconds of one cumsum's all-to-alls, forward and backward."""
    return 2 * estimate_all_to_all_s(prefix_input_bytes(dims, size), size, spec)


@dataclass(frozen=True)
class ScanDims:
    """One selective scan over the whole sequence: x (B, T, E), state (B, E, N) in the scan's dtype."""

    batch: int
    seq_len: int
    inner_dim: int  # E
    state_dim: int  # N
    state_itemsize: int  # of the scan's dtype, fp32 at least


def scan_state_bytes(dims: ScanDims) -> float:
    """One (B, E, N) state of the scan."""
    return dims.batch * dims.inner_dim * dims.state_dim * dims.state_itemsize


def state_passing_exchange_bytes(dims: ScanDims, size: int) -> float:
    """Bytes one rank sends for one scan's forward and backward by state passing: its final state
    and its slice's decay to each of the S - 1 other ranks, and as many gradients back; independent
    of T (NOTE [Scan by state passing] in passes/sequence/mixer_scan.py)."""
    return 2 * (size - 1) * 2 * scan_state_bytes(dims)


def state_passing_exchange_s(dims: ScanDims, size: int, spec: CommSpec) -> float:
    """Seconds of one scan's state all-to-all, forward and backward."""
    return 2 * estimate_all_to_all_s(size * 2 * scan_state_bytes(dims), size, spec)


@dataclass(frozen=True)
class FlipDims:
    """One flip along the sequence of a (…, T, …) tensor of ``numel`` elements."""

    numel: int
    itemsize: int


def flip_exchange_bytes(dims: FlipDims, size: int) -> float:
    """Bytes one rank sends for one flip's forward and backward: two all-to-alls of its slice each
    way, each sending (S - 1)/S of it (NOTE [Flip along the sequence] in passes/sequence/mixer_flip.py)."""
    return 2 * 2 * (size - 1) / size * dims.numel / size * dims.itemsize


def flip_exchange_s(dims: FlipDims, size: int, spec: CommSpec) -> float:
    """Seconds of one flip's two all-to-alls, forward and backward."""
    return 2 * 2 * estimate_all_to_all_s(dims.numel / size * dims.itemsize, size, spec)


@dataclass(frozen=True)
class DeclaredOpDims:
    """One op whose sharding its user declared (passes/sequence/mixer_custom.py): the bytes of one position
    of each sequence-sharded input and of the output, over a whole sequence of ``seq_len``."""

    input_position_bytes: tuple[int, ...]
    output_position_bytes: int
    seq_len: int
    halo: int  # positions before a rank's slice the op reads ("halo" only)


def declared_exchange_bytes(dims: DeclaredOpDims, exchange: str, size: int) -> float:
    """Bytes one rank sends for one declared op's forward and backward, by its exchange:
    ``"halo"`` its last ``halo`` positions of each input to the S - 1 other ranks; ``"gather"`` its
    whole slice of each input to them; ``"channels"`` (S - 1)/S of its slice of each input and of
    the output (to channel shards and back). As many gradients go back as values came."""
    local, inputs = dims.seq_len // size, sum(dims.input_position_bytes)
    if exchange == "halo":
        return 2 * (size - 1) * dims.halo * inputs
    if exchange == "gather":
        return 2 * (size - 1) * local * inputs
    assert exchange == "channels", exchange
    return 2 * (size - 1) / size * local * (inputs + dims.output_position_bytes)
