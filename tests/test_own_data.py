"""Training on your own genome and your own model: FASTA checks, the Nucleotide Transformer's
k-mer tokenizer, masked-LM masking, ``--model`` specs, ``--objective`` and ``--kmer``; and a
Hugging Face ESM trained with MLM at ZeRO stage 3 on 2 gloo ranks through ``zerofx train``."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from tests.support.fasta import write_fasta

from zerofx.app.cli import main
from zerofx.data.genome import GenomeError, genome_stats, genome_windows, read_fasta
from zerofx.data.mlm import IGNORE_INDEX, MlmMasking, mask_seed, mask_tokens
from zerofx.data.tokenizers import MAX_KMER, KmerTokenizer
from zerofx.common.errors import UsageError, ZeroFXError
from zerofx.app.training import (
    Objective,
    TrainOptions,
    _cycle_batches,
    build_model,
    check_train_options,
    input_embedding_rows,
    vocabulary_size,
)

ROOT = Path(__file__).resolve().parents[1]
ESM_SPEC = f"{ROOT}/tests/support/own_models.py:build_esm"

# InstaDeepAI/nucleotide-transformer-v2-50m-3mer-multi-species/vocab.txt on the Hugging Face Hub,
# one token per line there: the reference the 3-mer layout must equal.
NT_3MER_VOCAB = (
    "<unk> <pad> <mask> <cls> <eos> <bos> AAA AAT AAC AAG ATA ATT ATC ATG ACA ACT ACC ACG AGA AGT AGC AGG TAA TAT TAC "
    "TAG TTA TTT TTC TTG TCA TCT TCC TCG TGA TGT TGC TGG CAA CAT CAC CAG CTA CTT CTC CTG CCA CCT CCC CCG CGA CGT CGC "
    "CGG GAA GAT GAC GAG GTA GTT GTC GTG GCA GCT GCC GCG GGA GGT GGC GGG A T C G N"
).split()



# --------------------------------------------------------------------------- tokenizer
def test_vocabulary_layout_is_the_nucleotide_transformers() -> None:
    assert list(KmerTokenizer(3).vocab) == NT_3MER_VOCAB
    six = KmerTokenizer(6)
    assert six.vocab_size == 4107  # the 6-mer models' config.json: "vocab_size": 4107
    assert six.vocab[:6] == ("<unk>", "<pad>", "<mask>", "<cls>", "<eos>", "<bos>")
    assert six.vocab[6:11] == ("AAAAAA", "AAAAAT", "AAAAAC", "AAAAAG", "AAAATA")
    assert six.vocab[4101:] == ("GGGGGG", "A", "T", "C", "G", "N")
    assert (six.pad_id, six.mask_id) == (1, 2)  # the configs' pad_token_id and mask_token_id
    assert KmerTokenizer(1).vocab_size == 15 and KmerTokenizer(2).vocab_size == 6 + 16 + 5


def test_six_mer_ids_from_the_layout() -> None:
    tok = KmerTokenizer(6)

    def kmer_id(kmer: str) -> int:  # 6 specials, then the k-mer's rank in base 4 over A=0 T=1 C=2 G=3
        return 6 + sum("ATCG".index(c) * 4 ** (5 - i) for i, c in enumerate(kmer))

    assert kmer_id("ATCGAA") == 438 and kmer_id("GGGGGG") == 4101
    for kmer in ("AAAAAA", "AAAAAT", "ATCGAA", "TGGCGA", "GGCGAT", "CCCCCC", "GGGGGG"):
        assert tok.encode(kmer).tolist() == [kmer_id(kmer)] == [tok.token_to_id(kmer)]
    assert tok.encode("ATCGAATGGCGA").tolist() == [kmer_id("ATCGAA"), kmer_id("TGGCGA")]
    # Single nucleotides A T C G N are the last five ids (4102..4106).
    assert tok.encode("A").tolist() == [4102] and tok.encode("N").tolist() == [4106]


def test_tails_n_and_ambiguity_codes() -> None:
    tok = KmerTokenizer(6)
    a, t, c, g, n = 4102, 4103, 4104, 4105, 4106
    assert tok.encode("AAAAAAT").tolist() == [6, t]  # AAAAAA + a tail of one
    assert tok.encode("TAAAAAA").tolist() == [tok.token_to_id("TAAAAA"), a]  # greedy from the left
    # N is a token of its own and the k-mers restart after it (NT's docstring example, for k=6).
    assert tok.decode(tok.encode("ATCGAATNGGCGATGCAC")).split() == ["ATCGAATNGGCGATGCAC"]
    assert tok.encode("ATCGAATNGGCGATGCAC").tolist() == [438, t, n, tok.token_to_id("GGCGAT"), g, c, a, c]
    three = KmerTokenizer(3)
    # Other ambiguity codes are <unk> (0), ending the run; a run of them is one <unk>.
    assert three.encode("ACGTRACGT").tolist() == [17, 71, 0, 17, 71]
    assert three.encode("ACGRYACG").tolist() == [17, 0, 17]
    # zerofx's reading rules first: lowercase as uppercase, U as T.
    assert three.encode("acgu").tolist() == three.encode("ACGT").tolist()
    # k = 1: the k-mers and the single nucleotides are the same strings; NT's lookup keeps the later id.
    assert KmerTokenizer(1).encode("ATCGN").tolist() == [10, 11, 12, 13, 14]
    for bad in (0, MAX_KMER + 1, True, 2.0):
        with pytest.raises(ZeroFXError, match="k-mer size"):
            KmerTokenizer(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_round_trip_and_streaming(k: int) -> None:
    tok, rng = KmerTokenizer(k), random.Random(k)
    for _ in range(50):
        seq = "".join(rng.choice("ACGTACGTN") for _ in range(rng.randrange(60)))
        ids = tok.encode(seq)
        assert tok.decode(ids) == seq
        cuts = sorted(rng.sample(range(len(seq) + 1), min(4, len(seq) + 1)))
        pieces = [seq[i:j] for i, j in zip([0, *cuts], [*cuts, len(seq)])]
        assert torch.cat(list(tok.encode_chunks(pieces))).tolist() == ids.tolist()  # chunk boundaries change nothing


@pytest.mark.parametrize("k", [1, 3, 6])
def test_ids_equal_transformers_esm_tokenizer_on_the_nt_vocab(k: int, tmp_path: Path) -> None:
    """Hugging Face's EsmTokenizer on NT's vocab.txt is what NT's Hub models tokenize with."""
    from transformers import EsmTokenizer

    tok = KmerTokenizer(k)
    (tmp_path / "vocab.txt").write_text("\n".join(tok.vocab))
    reference = EsmTokenizer(str(tmp_path / "vocab.txt"))
    rng = random.Random(0)
    for trial in range(100):
        seq = "".join(rng.choice("ACGT" if trial % 2 else "ACGTACGTNRY") for _ in range(rng.randrange(50)))
        assert tok.encode(seq).tolist() == reference(seq, add_special_tokens=False)["input_ids"], seq


# --------------------------------------------------------------------------- masking
def _masking(tok: KmerTokenizer) -> MlmMasking:
    return MlmMasking(mask_id=tok.mask_id, random_ids=tok.sequence_ids)


def test_masking_fractions_labels_and_replacements() -> None:
    tok = KmerTokenizer(6)
    tokens = torch.randint(6, tok.vocab_size, (100, 2000), generator=torch.Generator().manual_seed(0))
    original = tokens.clone()
    inputs, labels = mask_tokens(tokens, _masking(tok), seed=mask_seed(0, 0, 0))
    assert torch.equal(tokens, original)  # not modified in place
    chosen = labels != IGNORE_INDEX
    # 200,000 tokens: the standard error of the 15% is 0.0008, of the 80% and 10% about 0.002.
    assert chosen.float().mean().item() == pytest.approx(0.15, abs=0.005)
    assert torch.equal(labels[chosen], original[chosen])
    assert torch.equal(inputs[~chosen], original[~chosen])  # nothing changes where the label is -100
    masked = inputs[chosen] == tok.mask_id
    unchanged = inputs[chosen] == original[chosen]
    randomized = ~masked & ~unchanged
    n = chosen.sum().item()
    assert masked.sum().item() / n == pytest.approx(0.8, abs=0.01)
    assert randomized.sum().item() / n == pytest.approx(0.1, abs=0.01)  # a random draw equals the original 1 in 4101
    assert unchanged.sum().item() / n == pytest.approx(0.1, abs=0.01)
    assert int(inputs[chosen][randomized].min()) >= 6  # random tokens are sequence tokens, never special


def test_masking_skips_special_tokens_and_always_masks_one() -> None:
    tok = KmerTokenizer(1)
    tokens = torch.tensor([[0, 1, 10, 11] * 50])  # <unk>, <pad> and two bases
    inputs, labels = mask_tokens(tokens, _masking(tok), seed=1)
    special = tokens < 6
    assert (labels[special] == IGNORE_INDEX).all() and torch.equal(inputs[special], tokens[special])
    assert (labels[~special] != IGNORE_INDEX).any()
    # Two tokens a batch: without the rule, 72% of batches would have no label (a NaN loss).
    for seed in range(200):
        _, labels = mask_tokens(torch.tensor([[10, 12]]), _masking(tok), seed=seed)
        assert (labels != IGNORE_INDEX).sum() >= 1
    _, labels = mask_tokens(torch.tensor([[0, 0]]), _masking(tok), seed=0)  # nothing eligible: one anyway
    assert (labels != IGNORE_INDEX).sum() == 1


def test_masking_is_a_function_of_seed_rank_and_batch() -> None:
    tok = KmerTokenizer(6)
    tokens = torch.randint(6, tok.vocab_size, (4, 256), generator=torch.Generator().manual_seed(1))
    first = mask_tokens(tokens, _masking(tok), seed=mask_seed(7, 1, 3))
    again = mask_tokens(tokens, _masking(tok), seed=mask_seed(7, 1, 3))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    seeds = {mask_seed(7, 1, 3), mask_seed(8, 1, 3), mask_seed(7, 0, 3), mask_seed(7, 1, 4), mask_seed(7, 1, 3, split="eval")}
    assert len(seeds) == 5
    other = mask_tokens(tokens, _masking(tok), seed=mask_seed(7, 1, 4))
    assert not torch.equal(first[1], other[1])
    with pytest.raises(ZeroFXError, match="mask_fraction"):
        MlmMasking(mask_id=2, random_ids=range(6, 10), mask_fraction=0)


def test_training_batches_resume_with_the_same_masks() -> None:
    """The n-th (inputs, labels) of a rank's stream is the same in every run: a resumed run,
    which skips the batches its checkpoint trained on, masks the rest as the uninterrupted one."""
    opts = check_train_options(TrainOptions(model=ESM_SPEC, objective=Objective.MLM, seq_len=64, world_size=2))
    whole = list(itertools.islice(_cycle_batches(opts, 1), 6))
    resumed = _cycle_batches(opts, 1)
    for _ in range(4):
        next(resumed)
    for (x, y), (x2, y2) in zip(whole[4:], resumed):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    other_rank = next(_cycle_batches(opts, 0))
    assert not torch.equal(other_rank[0], whole[0][0])
    # At world size 1 the same windows come in another grouping, masked alike: sample j is masked
    # by its own seed, whoever draws it (rank 1's first batch at 2 ranks holds samples 2 and 3).
    alone = check_train_options(TrainOptions(model=ESM_SPEC, objective=Objective.MLM, seq_len=64, world_size=1, batch_size=4))
    x1, y1 = next(_cycle_batches(alone, 0))
    assert torch.equal(x1[2:], whole[0][0]) and torch.equal(y1[2:], whole[0][1])
    for inputs, labels in whole:
        assert inputs.shape == labels.shape == (2, 64) and inputs.dtype == labels.dtype == torch.long
        assert (labels == IGNORE_INDEX).float().mean() > 0.5 and (inputs == 2).any()
    clm = check_train_options(TrainOptions(seq_len=64))
    inputs, labels = next(_cycle_batches(clm, 0))
    assert torch.equal(inputs, labels) and int(inputs.max()) <= 4  # clm: the bundled A C G T N ids, unchanged


# --------------------------------------------------------------------------- FASTA files
def test_empty_files_and_headers_only(tmp_path: Path) -> None:
    for name, text, gz in (("empty.fa", "", False), ("empty.fa.gz", "", True), ("blank.fa", "\n\n  \n", False)):
        with pytest.raises(GenomeError, match=r"is empty"):
            read_fasta(write_fasta(tmp_path / name, text, gz=gz))
    with pytest.raises(GenomeError, match=r"has 2 header lines but no sequence lines"):
        read_fasta(write_fasta(tmp_path / "headers.fa", ">chr1 first\n\n>chr2\n"))


def test_foreign_symbol_names_count_record_and_offset(tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "z.fa", ">chr1 one\nACGTACGT\n>chr2\nACGTACGTAC\nGGZTT\n")
    with pytest.raises(GenomeError, match=r"1 of its first 23 sequence symbols .* the first is 'Z' in record 'chr2' at offset 12 \(line 5, column 3\)"):
        read_fasta(path)
    with pytest.raises(GenomeError, match=r"3 of its first 8 .* 'Z' in record 'r' at offset 2 \(line 2, column 3\)"):
        genome_windows(write_fasta(tmp_path / "three.fa.gz", ">r\nACZGTZ\nAZ\n", gz=True), 4)
    # A symbol that is not a sequence symbol at all is refused at once, with its place.
    with pytest.raises(GenomeError, match=r"line 3: '1' in record 'x' at offset 8 \(column 3\) is not a sequence symbol \(2 such"):
        list(read_fasta(write_fasta(tmp_path / "digit.fa", ">x\nACGTAC\nAC1G2T\n")))
    # Below 1% (and never more than 1% later), foreign symbols read as N and are counted.
    stats = genome_stats(write_fasta(tmp_path / "few.fa", ">a\n" + "ACGT" * 50 + "X\n"))
    assert (stats.num_foreign, stats.num_n) == (1, 1) and "'X' in record 'a' at offset 200" in stats.summary()


def test_corrupt_gzip(tmp_path: Path) -> None:
    good = write_fasta(tmp_path / "good.fa.gz", ">a\n" + "ACGTTGCA" * 2000 + "\n", gz=True)
    data = good.read_bytes()
    (tmp_path / "truncated.fa.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(GenomeError, match=r"truncated.fa.gz' is corrupt \(gzip\) after line \d+"):
        read_fasta(tmp_path / "truncated.fa.gz")
    flipped = bytearray(data)
    flipped[-8] ^= 0xFF  # the trailer's CRC-32: found wrong only at the end of the stream
    (tmp_path / "crc.fa.gz").write_bytes(bytes(flipped))
    read_fasta(tmp_path / "crc.fa.gz")  # the first FOREIGN_CHECK_MIN_SYMBOLS read fine
    with pytest.raises(GenomeError, match=r"crc.fa.gz' is corrupt \(gzip\) after line 2: CRC check failed"):
        genome_stats(tmp_path / "crc.fa.gz")  # a whole pass, as zerofx train makes before starting ranks


def test_multi_record_gzip_reads_every_record(tmp_path: Path) -> None:
    rng = random.Random(3)
    records = {f"chr{i}": "".join(rng.choice("ACGT") for _ in range(n)) for i, n in enumerate((700, 130, 1001), start=1)}
    path = write_fasta(tmp_path / "multi.fa.gz", "".join(f">{name} description\n{seq[:400]}\n{seq[400:]}\n"
                                                    for name, seq in records.items()), gz=True)
    read: dict[str, str] = {}
    for name, chunk in read_fasta(path, chunk_chars=64):
        read[name] = read.get(name, "") + chunk
    assert read == records
    stats = genome_stats(path)
    assert (stats.num_records, stats.num_bases) == (3, 1831)
    # k-mer windows: each record is tokenized whole and cut into windows of its own tokens.
    tok = KmerTokenizer(6)
    windows = [w for b in genome_windows(path, 16, batch_size=1, shuffle_windows=0, tokenizer=tok) for w in b]
    expected = [tok.encode(seq)[i * 16:(i + 1) * 16] for seq in records.values() for i in range(len(tok.encode(seq)) // 16)]
    # 700 bases: 116 6-mers and 4 single tail bases, 120 tokens, 7 windows; 130: 25 tokens, 1; 1001: 171 tokens, 10.
    assert len(windows) == len(expected) == 7 + 1 + 10
    assert all(torch.equal(w, e) for w, e in zip(windows, expected))


# --------------------------------------------------------------------------- options and models
def test_vocabulary_rule_and_model_checks(tmp_path: Path) -> None:
    clm = check_train_options(TrainOptions(seq_len=64))
    assert clm.objective is Objective.CLM and vocabulary_size(clm) == 5  # the bundled A C G T N, unchanged
    kmer = check_train_options(TrainOptions(seq_len=64, kmer=6))
    assert vocabulary_size(kmer) == 4107
    assert input_embedding_rows(build_model(kmer, torch.device("cpu"))) == 4107
    mlm = check_train_options(TrainOptions(model=ESM_SPEC, objective="mlm", seq_len=64))  # type: ignore[arg-type]
    assert mlm.objective is Objective.MLM and vocabulary_size(mlm) == 15  # k = 1 in NT's layout
    with pytest.raises(UsageError, match=r"input embedding has 10 rows, but .* ids up to 14; build the model with vocab_size >= 15"):
        check_train_options(TrainOptions(model=f"{ROOT}/tests/support/own_models.py:build_esm_too_small", objective=Objective.MLM,
                                         seq_len=8))
    with pytest.raises(UsageError, match="--objective mlm needs a bidirectional model"):
        check_train_options(TrainOptions(objective=Objective.MLM, seq_len=64))
    with pytest.raises(UsageError, match=f"--kmer 9 is invalid; accepted: an integer in 1..{MAX_KMER}"):
        check_train_options(TrainOptions(kmer=9))
    with pytest.raises(UsageError, match="--objective 'bert' is invalid; accepted: clm, mlm"):
        check_train_options(TrainOptions(objective="bert"))  # type: ignore[arg-type]
    with pytest.raises(ZeroFXError, match="model spec file 'nowhere.py' does not exist"):
        check_train_options(TrainOptions(model="nowhere.py:f"))


def test_example_specs_fit_the_6mer_vocabulary() -> None:
    from zerofx.compiler.materialize import iter_initial_state
    from zerofx.app.training import check_vocabulary, load_spec_model

    for name in ("esm_mlm", "llama_clm"):
        model = load_spec_model(f"{ROOT}/examples/own_models.py:{name}")
        check_vocabulary(model, TrainOptions(model=name, kmer=6))
        # Built on the meta device: every tensor gets a finite initial value on the ranks.
        assert all(torch.isfinite(t.value).all() for t in iter_initial_state(model, seed=0))


def test_cli_train_flags_help_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for text in ("--objective {clm,mlm}", "--kmer K", f"1..{MAX_KMER}", "80/10/10", "FILE.py:CALLABLE", "Nucleotide Transformer"):
        assert text in out, text
    bad = write_fasta(tmp_path / "bad.fa", ">a\nACGZ\n")
    for argv, message in ((["--fasta", str(bad)], "'Z' in record 'a' at offset 3"), (["--objective", "mlm"], "needs a bidirectional"),
                          (["--kmer", "0"], "argument --kmer: 0 is out of range")):
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("zerofx: error: ") and message in err and err.count("\n") == 1


# --------------------------------------------------------------------------- training
def test_esm_trains_with_mlm_at_stage3_on_two_ranks(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train", "--model", ESM_SPEC, "--objective", "mlm", "--world-size", "2", "--stage", "3",
            "--steps", "12", "--seq-len", "64", "--output-dir", str(run), "--collective-timeout", "120"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "masked-token prediction (mlm" in out and "1-mers in the Nucleotide Transformer's vocabulary (15 ids)" in out
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "step" in r]
    assert len(losses) == 12
    # Untrained, the model guesses about uniformly over 15 ids (ln 15 = 2.71); it learns at
    # least the base frequencies (ln 4 = 1.39 for a masked base) within these steps.
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert abs(losses[0] - 2.71) < 0.3 and last < first - 0.3, losses
    assert "eval_loss" in log[-1] and log[-1]["eval_loss"] < losses[0]
