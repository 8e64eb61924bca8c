"""The Nucleotide Transformer's k-mer tokenizer: its vocabulary layout and its ids, streamed.

    tok = KmerTokenizer(6)
    tok.vocab_size                 # 4107: 6 special tokens, 4**6 6-mers, A T C G N
    tok.encode("ATCGAATNGGCGATGCAC").tolist()   # [438, 4103, 4106, 4023, 4105, 4104, 4102, 4104]

NOTE [The Nucleotide Transformer's vocabulary]
The layout is the one InstaDeep ships with the Nucleotide Transformer (NT) on the Hugging Face
Hub, e.g. ``InstaDeepAI/nucleotide-transformer-v2-50m-3mer-multi-species/vocab.txt``
(``<unk> <pad> <mask> <cls> <eos> <bos> AAA AAT AAC ... GGG A T C G N``, 75 lines) and the
6-mer models' 4,107-line file with the same shape; their configs say ``vocab_size`` 4107,
``pad_token_id`` 1, ``mask_token_id`` 2:

    ids 0..5            <unk> <pad> <mask> <cls> <eos> <bos>
    ids 6..6+4**k-1     every k-mer, in lexicographic order over A < T < C < G
                        (itertools.product("ATCG", repeat=k): AAA, AAT, AAC, AAG, ATA, ...)
    the last 5 ids      A T C G N, single nucleotides

(NT's JAX package, ``nucleotide_transformer/tokenizers.py``, builds the same tokens from
``constants.NUCLEOTIDES = ["A", "T", "C", "G"]`` but puts ``<eos> <bos>`` last; the Hub's
``vocab.txt``, which Hugging Face's ``EsmTokenizer`` loads, is the layout followed here.)

How a sequence becomes ids, as NT's ``NucleotidesKmersTokenizer.tokenize`` does it and as
``EsmTokenizer`` does it on NT's ``vocab.txt`` (the tests compare against ``EsmTokenizer``):

- N is always a token of its own and ends the run of bases before it. Every other symbol
  that is not A, C, G or T (the IUPAC ambiguity codes R Y S W K M B D H V, and the foreign
  symbols ``zerofx.data.genome`` tolerates) is ``<unk>`` and also ends the run; consecutive
  such symbols make one ``<unk>``, as in ``EsmTokenizer`` (NT's JAX tokenizer raises on them).
- Each run of bases is cut into non-overlapping k-mers from its start; the run's last
  ``len % k`` bases are single-nucleotide tokens.
- An id is the last position of its string in the vocabulary (NT's ``{tok: i for i, tok in
  enumerate(vocab)}``). This matters only for k = 1, where the k-mers A T C G and the single
  nucleotides are the same strings: every base gets its single-nucleotide id (10..13) and ids
  6..9 never occur.

zerofx's reading rules come first (``zerofx.data.genome``): lowercase reads as uppercase and U
as T. Nothing is prepended or appended: a window holds sequence tokens only, no ``<cls>``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from zerofx.common.errors import ZeroFXError

SPECIAL_TOKENS = ("<unk>", "<pad>", "<mask>", "<cls>", "<eos>", "<bos>")
UNK_ID, PAD_ID, MASK_ID, CLS_ID, EOS_ID, BOS_ID = range(len(SPECIAL_TOKENS))
NT_NUCLEOTIDES = "ATCG"  # NT's order, which orders the k-mers too
MAX_KMER = 8  # 65,547 tokens; NT itself uses k = 6 (and 3)
# Codes of the symbols a chunk holds: a base 0..3 in NT's order, N 4, anything else 5 (<unk>).
_BASE_CODES, _N_CODE, _UNK_CODE = 4, 4, 5
_CODE_TABLE = bytes(
    NT_NUCLEOTIDES.index(c) if c in NT_NUCLEOTIDES else NT_NUCLEOTIDES.index("T") if c == "U" else _N_CODE if c == "N" else _UNK_CODE
    for c in (chr(b).upper() for b in range(256))
)


def _codes(sequence: str) -> torch.Tensor:
    """Symbol codes of ``sequence`` (int64, (L,)): 0..3 for A T C G (U as T, either case), 4 for N, 5 otherwise."""
    if not sequence:
        return torch.empty(0, dtype=torch.long)
    data = bytearray(sequence.encode("ascii", errors="replace").translate(_CODE_TABLE))
    return torch.frombuffer(data, dtype=torch.uint8).long()


@dataclass(frozen=True)
class KmerTokenizer:
    """Non-overlapping k-mers in the Nucleotide Transformer's vocabulary (NOTE [The Nucleotide
    Transformer's vocabulary]). Frozen and picklable: training ranks get a copy."""

    k: int
    vocab: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _token_to_id: dict[str, int] = field(init=False, repr=False, compare=False)
    _kmer_ids: torch.Tensor = field(init=False, repr=False, compare=False)  # (4**k,) k-mer index -> id
    _single_ids: torch.Tensor = field(init=False, repr=False, compare=False)  # (6,) code -> id of a lone symbol
    _powers: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_KMER:
            raise ZeroFXError(f"k-mer size {self.k!r} is invalid; accepted: an integer in 1..{MAX_KMER}")
        kmers = ["".join(p) for p in itertools.product(NT_NUCLEOTIDES, repeat=self.k)]
        vocab = (*SPECIAL_TOKENS, *kmers, *NT_NUCLEOTIDES, "N")
        token_to_id = {tok: i for i, tok in enumerate(vocab)}  # the later duplicate wins, as in NT (k = 1)
        object.__setattr__(self, "vocab", vocab)
        object.__setattr__(self, "_token_to_id", token_to_id)
        object.__setattr__(self, "_kmer_ids", torch.tensor([token_to_id[s] for s in kmers]))
        single = [token_to_id[c] for c in NT_NUCLEOTIDES] + [token_to_id["N"], UNK_ID]
        object.__setattr__(self, "_single_ids", torch.tensor(single))
        object.__setattr__(self, "_powers", 4 ** torch.arange(self.k - 1, -1, -1))  # (k,) place values

    # Unpickling a frozen dataclass with init=False fields: rebuild them from k.
    def __reduce__(self) -> tuple[type, tuple[int]]:
        return (KmerTokenizer, (self.k,))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def mask_id(self) -> int:
        return MASK_ID

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def sequence_ids(self) -> range:
        """The ids ``encode`` can give besides ``<unk>``: k-mers, single nucleotides and N."""
        return range(int(self._kmer_ids.min()), self.vocab_size)

    @property
    def token_dtype(self) -> torch.dtype:
        """The narrowest integer dtype that holds every id (windows wait in shuffle buffers)."""
        return torch.int16 if self.vocab_size <= torch.iinfo(torch.int16).max else torch.int32

    def token_to_id(self, token: str) -> int:
        try:
            return self._token_to_id[token]
        except KeyError:
            raise ZeroFXError(f"{token!r} is not in the {self.k}-mer vocabulary") from None

    def encode(self, sequence: str) -> torch.Tensor:
        """The ids of one whole sequence (int64, 1-D)."""
        encoder = self.encoder()
        return torch.cat((encoder.feed(sequence), encoder.finish())).long()

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """The tokens' strings, concatenated: ``decode(encode(s)) == s.upper()`` for s over A C G T N."""
        values = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.vocab[i] for i in values)

    def encoder(self) -> KmerEncoder:
        """A streaming encoder for one record: ``feed`` its chunks in order, then ``finish``."""
        return KmerEncoder(self)

    def encode_chunks(self, chunks: Iterable[str]) -> Iterator[torch.Tensor]:
        """The ids of one record given as consecutive chunks, piece by piece."""
        encoder = self.encoder()
        for chunk in chunks:
            yield encoder.feed(chunk)
        yield encoder.finish()

    def _encode_codes(self, codes: torch.Tensor, final: bool, after_unk: bool) -> tuple[torch.Tensor, int]:
        """Ids of ``codes`` (L,), and how many codes they cover. Unless ``final``, the trailing
        run's bases after its last whole k-mer are held back: the next chunk may complete them.
        ``after_unk``: the code before ``codes[0]`` was an ``<unk>`` symbol, whose token is out."""
        k, length = self.k, codes.numel()
        if length == 0:
            return torch.empty(0, dtype=self.token_dtype), 0
        is_base = codes < _BASE_CODES
        if bool(is_base.all()):  # the common chunk, one run of bases: whole k-mers from its start
            num_kmers = length // k
            ids = self._kmer_ids[(codes[: num_kmers * k].view(num_kmers, k) * self._powers).sum(1)]
            if not final:
                return ids.to(self.token_dtype), num_kmers * k
            return torch.cat((ids, self._single_ids[codes[num_kmers * k :]])).to(self.token_dtype), length
        pos = torch.arange(length)
        last_break = torch.where(is_base, -1, pos).cummax(0).values  # the N or <unk> before each position, or -1
        offset = pos - last_break - 1  # position within its run of bases
        next_break = torch.where(is_base, length, pos).flip(0).cummin(0).values.flip(0)  # the break after, or L
        kmer_start = pos - offset % k  # where this base's k-mer starts
        in_kmer = is_base & (next_break - kmer_start >= k)
        consumed = length
        if not final and bool(is_base[-1]):  # the last run may go on in the next chunk
            consumed = length - int(offset[-1] + 1) % k  # the run's bases after its last whole k-mer
        first = in_kmer & (offset % k == 0)
        padded = torch.cat((codes, codes.new_zeros(k)))
        index = torch.zeros(length, dtype=torch.long)
        for j in range(k):  # the k-mer's index in product("ATCG", repeat=k); garbage where not ``first``
            index = index * 4 + padded[j : j + length].clamp(max=3)
        ids = torch.where(first, self._kmer_ids[index.where(first, 0)], self._single_ids[codes.clamp(max=_UNK_CODE)])
        is_unk = codes == _UNK_CODE
        repeated_unk = is_unk & torch.cat((torch.tensor([after_unk]), is_unk[:-1]))  # one <unk> per run of them
        emit = (first | ~in_kmer) & ~repeated_unk & (pos < consumed)
        return ids[emit].to(self.token_dtype), consumed


class KmerEncoder:
    """One record's streaming encoder: the ids of consecutive chunks equal ``encode`` of their
    concatenation. At most k - 1 bases wait between calls."""

    def __init__(self, tokenizer: KmerTokenizer) -> None:
        self.tokenizer = tokenizer
        self._held = torch.empty(0, dtype=torch.long)  # bases the next chunk may complete into a k-mer
        self._after_unk = False  # the last code encoded was an <unk> symbol

    def feed(self, chunk: str) -> torch.Tensor:
        codes = torch.cat((self._held, _codes(chunk)))
        ids, consumed = self.tokenizer._encode_codes(codes, final=False, after_unk=self._after_unk)
        if consumed:
            self._after_unk = bool(codes[consumed - 1] == _UNK_CODE)
        self._held = codes[consumed:]
        return ids

    def finish(self) -> torch.Tensor:
        ids, _ = self.tokenizer._encode_codes(self._held, final=True, after_unk=self._after_unk)
        self._held, self._after_unk = torch.empty(0, dtype=torch.long), False
        return ids
