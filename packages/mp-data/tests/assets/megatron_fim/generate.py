"""Record what Megatron-LM's fill-in-the-middle (FIM) transform does to fixed samples.

Run from the repository root with a Python that has megatron-core (with
megatron.training), numpy and tokenizers installed:

    python packages/mp-data/tests/assets/megatron_fim/generate.py

It writes, next to this file:

* tokenizer.json: a small byte-level BPE tokenizer trained on the inline corpus below;
* cases.json: for each case, the input sample, the settings, and the token ids that
  Megatron's ``GPTFIMDataset._query_document_sample_shuffle_indices`` returned for it,
  plus how many times Megatron drew from its ``np_rng``.

Both files are byte-identical from one run to the next.
"""

from __future__ import annotations

import itertools
import json
import sys
import warnings
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

with warnings.catch_warnings():
    # Importing megatron.training pulls in model code that warns about Apex, CUDA, etc.
    warnings.simplefilter("ignore")
    from megatron.training.datasets.fim_dataset import GPTFIMDataset

HERE = Path(__file__).resolve().parent
TOKENIZER_PATH = HERE / "tokenizer.json"
CASES_PATH = HERE / "cases.json"

EOD = "<|endoftext|>"
PREFIX = "<fim_prefix>"
MIDDLE = "<fim_middle>"
SUFFIX = "<fim_suffix>"
PAD = "<fim_pad>"
FILE_SEP = "<file_sep>"
SPECIAL_TOKENS = [EOD, PREFIX, MIDDLE, SUFFIX, PAD, FILE_SEP]
VOCAB_SIZE = 400

# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

TRAINING_CORPUS = """\
import os
import sys
from pathlib import Path


def read_lines(path):
    \"\"\"Return the lines of a text file, without trailing newlines.\"\"\"
    with open(path) as handle:
        return [line.rstrip("\\n") for line in handle]


def count_words(lines):
    counts = {}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    return counts


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)


def main(argv):
    if len(argv) < 2:
        print("usage: count.py FILE")
        return 1
    counts = count_words(read_lines(Path(argv[1])))
    for word, number in sorted(counts.items()):
        print(word, number)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

The quick brown fox jumps over the lazy dog.
A function returns a value to the code that called it.
The stack keeps its items in the order they were pushed,
and the last item pushed is the first one to be popped.
Each line of the file is read, split into words, and counted.
The program prints every word with the number of times it was seen.
Training data for a language model is a long list of token ids.
"""


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_CORPUS.splitlines(keepends=True), trainer=trainer)
    # The trainer already adds its special tokens as special; this keeps that explicit.
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


# ---------------------------------------------------------------------------
# Stand-ins for the objects GPTFIMDataset reads
# ---------------------------------------------------------------------------


class TextTokenizer:
    """The ``config.tokenizer._tokenizer`` interface that GPTFIMDataset calls."""

    def __init__(self, backend: Tokenizer):
        self.backend = backend

    def ids_to_text(self, ids, remove_special_tokens=True):
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=remove_special_tokens)

    def text_to_ids(self, text):
        return self.backend.encode(text, add_special_tokens=False).ids

    def tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]


class OneDocumentDataset:
    """The ``dataset`` (IndexedDataset) interface: one document, the sample."""

    def __init__(self, sample):
        self.sample = np.asarray(sample, dtype=np.int64)

    def get(self, doc, offset=0, length=None):
        assert doc == 0
        end = None if length is None else offset + length
        return self.sample[offset:end]


class CountingRandomState:
    """Forwards binomial and randint to a RandomState and counts the calls."""

    def __init__(self, seed):
        self.rng = np.random.RandomState(seed)
        self.log = []

    @property
    def draws(self):
        return len(self.log)

    def binomial(self, *args, **kwargs):
        result = self.rng.binomial(*args, **kwargs)
        self.log.append(("binomial", args, kwargs, result))
        return result

    def randint(self, *args, **kwargs):
        result = self.rng.randint(*args, **kwargs)
        self.log.append(("randint", args, kwargs, result))
        return result


def run_megatron(
    backend: Tokenizer,
    sample,
    *,
    seed,
    fim_rate,
    fim_spm_rate,
    fim_split_sample=None,
    fim_fragment_rate=None,
    fim_no_prefix=None,
):
    text_tokenizer = TextTokenizer(backend)
    ds = object.__new__(GPTFIMDataset)
    ds.shuffle_index = np.array([0], dtype=np.int64)
    ds.sample_index = np.array([[0, 0], [0, len(sample) - 1]], dtype=np.int64)
    ds.document_index = np.array([0], dtype=np.int64)
    ds.dataset = OneDocumentDataset(sample)
    ds.config = SimpleNamespace(tokenizer=SimpleNamespace(_tokenizer=text_tokenizer))
    ds.np_rng = CountingRandomState(seed)
    ds.fim_rate = fim_rate
    ds.fim_spm_rate = fim_spm_rate
    ds.fragment_fim_rate = fim_fragment_rate
    # As GPTFIMDataset.__init__ does it.
    ds.fim_split_sample = (
        text_tokenizer.tokens_to_ids(fim_split_sample) if fim_split_sample else None
    )
    ds.no_fim_prefix = fim_no_prefix
    (
        ds.prefix_tok_id,
        ds.middle_tok_id,
        ds.suffix_tok_id,
        ds.pad_tok_id,
        ds.eod_tok_id,
    ) = text_tokenizer.tokens_to_ids([PREFIX, MIDDLE, SUFFIX, PAD, EOD])

    # Observe (without changing) the two helpers Megatron calls on each segment and
    # fragment: instance attributes shadow the class's methods, and each wrapper calls
    # the real method. What they record only serves the checks in CASES.
    permute_calls = []
    segment_calls = []

    def observed_permute(sequence, *args, **kwargs):
        first_draw = ds.np_rng.draws
        result = GPTFIMDataset._permute(ds, sequence, *args, **kwargs)
        permute_calls.append(
            SimpleNamespace(
                input=[int(t) for t in sequence],
                output=[int(t) for t in result],
                text=text_tokenizer.ids_to_text(sequence),
                draws=ds.np_rng.log[first_draw:],
            )
        )
        return result

    def observed_split_and_permute(sequence):
        result = GPTFIMDataset._fim_split_and_permute_sequence(ds, sequence)
        segment_calls.append(
            SimpleNamespace(input=[int(t) for t in sequence], output=[int(t) for t in result])
        )
        return result

    ds._permute = observed_permute
    ds._fim_split_and_permute_sequence = observed_split_and_permute

    tokens, document_ids, lengths = ds._query_document_sample_shuffle_indices(0)
    assert tokens.dtype == np.int64 and len(tokens) == len(sample)
    assert document_ids.tolist() == [0] and lengths == [len(sample)]
    # Length before Megatron truncates or pads: the permuted segments plus one EOD
    # after each segment but the last.
    untruncated = sum(len(c.output) for c in segment_calls) + len(segment_calls) - 1
    return SimpleNamespace(
        output=[int(t) for t in tokens],
        draws=ds.np_rng.draws,
        rng_log=ds.np_rng.log,
        permute_calls=permute_calls,
        segment_calls=segment_calls,
        untruncated_length=untruncated,
    )


# ---------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------

STACK = """\
class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
"""

COUNT = """\
def count_words(lines):
    counts = {}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    return counts
"""

FOX = "The quick brown fox jumps over the lazy dog.\n"

ADD = "def add(a, b):\n    return a + b\n"

READ = """\
def read_lines(path):
    with open(path) as handle:
        return [line.rstrip() for line in handle]
"""

PROSE = "A function returns a value to the code that called it.\n"

IMPORTS = "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n"

IMPORT_PATH = 'import pathlib\n\nroot = pathlib.Path(".")\n'

GREET = 'def greet():\n    return "héllo, wörld — 東京 🙂"\n'

# Files of a small repository, for the <file_sep> cases.
FILE_README = "# count\nCount the words of a file.\n"
FILE_INIT = "from .count import count_words\n"
FILE_TEST = "def test_add():\n    assert add(1, 2) == 3\n"
FILE_CLI = "import sys\n\nprint(sys.argv[1:])\n"
FILE_SETUP = 'name = "count"\nversion = "0.1"\n'
FILE_NOTE = "The last item pushed is the first one popped.\n"
FILE_MAIN = "def main():\n    return 0\n"

# One-line files of a repository, for a sample with seven <file_sep>.
TINY_FILES = [
    "x = 1\n", "y = 2\n", "print(x + y)\n", "# notes\n",
    "import os\n", "def f():\n    pass\n", "z = [x, y]\n", "The end.\n",
]  # fmt: skip


def sample_ids(backend: Tokenizer, pieces):
    """Token ids of the pieces: a special token's name gives its id, text is encoded."""
    ids = []
    for piece in pieces:
        if piece in SPECIAL_TOKENS:
            ids.append(backend.token_to_id(piece))
        else:
            ids.extend(backend.encode(piece, add_special_tokens=False).ids)
    return ids


# ---------------------------------------------------------------------------
# Checks that each case shows what its note says
# ---------------------------------------------------------------------------


def _permuted(call):
    """Whether a _permute call rearranged its input (it drew the two boundaries)."""
    return any(kind == "randint" for kind, *_ in call.draws)


def _spm(call):
    kind, _args, _kwargs, result = call.draws[-1]
    return _permuted(call) and kind == "binomial" and int(result) == 1


def _kept_for_prefix(call):
    """The FIM draw said yes but the text starts with fim_no_prefix."""
    return len(call.draws) == 1 and int(call.draws[0][3]) == 1 and call.output == call.input


def truncated(run, sample, ids):
    return run.untruncated_length > len(sample)


def padded(run, sample, ids):
    n = len(sample) - run.untruncated_length
    return n > 0 and run.output[-n:] == [ids["pad"]] * n


def all_permuted(run, sample, ids):
    return all(_permuted(c) for c in run.permute_calls)


def some_permuted_some_not(run, sample, ids):
    flags = [_permuted(c) for c in run.permute_calls]
    return any(flags) and not all(flags)


def all_psm(run, sample, ids):
    return all(_permuted(c) and not _spm(c) for c in run.permute_calls)


def all_spm(run, sample, ids):
    return all(_spm(c) for c in run.permute_calls)


def psm_and_spm(run, sample, ids):
    kinds = {_spm(c) for c in run.permute_calls if _permuted(c)}
    return kinds == {True, False}


def some_kept_for_prefix(run, sample, ids):
    return any(_kept_for_prefix(c) for c in run.permute_calls) and any(
        _permuted(c) for c in run.permute_calls
    )


def empty_permuted(run, sample, ids):
    """Some _permute call got an empty sequence and put the three sentinels out."""
    return any(c.input == [] and _permuted(c) for c in run.permute_calls)


def empty_sentinels_visible(run, sample, ids):
    """As empty_permuted, and the three sentinels survive in the output."""
    sentinels = [ids["prefix"], ids["suffix"], ids["middle"]]
    out = run.output
    return empty_permuted(run, sample, ids) and any(
        out[i : i + 3] == sentinels for i in range(len(out) - 2)
    )


def split_document_kept(run, sample, ids):
    """A document holding <file_sep> came back whole: the document-level draw said no."""
    return any(
        ids["file_sep"] in c.input and c.output == c.input for c in run.segment_calls
    ) and any(_permuted(c) for c in run.permute_calls)


def boundary_past_non_ascii(run, sample, ids):
    """A drawn boundary lies past the first non-ASCII character, so counting the
    characters as bytes instead of code points would cut the text elsewhere."""
    for call in run.permute_calls:
        boundaries = [b for kind, _, _, result in call.draws if kind == "randint" for b in result]
        first = next((i for i, ch in enumerate(call.text) if ord(ch) > 127), None)
        if first is not None and any(b > first for b in boundaries):
            return True
    return False


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

REPO = [FILE_README, FILE_SEP, FILE_INIT, FILE_SEP, FILE_TEST, FILE_SEP, FILE_CLI]
REPO_B = [FILE_SETUP, FILE_SEP, FILE_MAIN, FILE_SEP, FILE_NOTE, FILE_SEP, FILE_INIT]
REPO_TWO_DOCS = [FILE_README, FILE_SEP, FILE_MAIN, EOD, FILE_CLI, FILE_SEP, FILE_TEST]
# Without split mode, <file_sep> tokens are special tokens that decoding drops.
REPO_FIVE_SEPS = [
    FILE_README, FILE_SEP, FILE_INIT, FILE_SEP, FILE_MAIN, FILE_SEP,
    FILE_SETUP, FILE_SEP, FILE_NOTE, FILE_SEP, FILE_MAIN,
]  # fmt: skip
REPO_SEVEN_SEPS = [piece for text in TINY_FILES for piece in (text, FILE_SEP)][:-1]

SPLIT = {"fim_split_sample": FILE_SEP}
SETTINGS = (
    "seed",
    "fim_rate",
    "fim_spm_rate",
    "fim_split_sample",
    "fim_fragment_rate",
    "fim_no_prefix",
)


def case(name, pieces, seed, fim_rate, fim_spm_rate, checks, note, **options):
    """A case: the sample's pieces, Megatron's settings, and the checks its note claims."""
    return {
        "name": name,
        "pieces": pieces,
        "seed": seed,
        "fim_rate": fim_rate,
        "fim_spm_rate": fim_spm_rate,
        "fim_split_sample": options.pop("fim_split_sample", None),
        "fim_fragment_rate": options.pop("fim_fragment_rate", None),
        "fim_no_prefix": options.pop("fim_no_prefix", None),
        "note": note,
        "checks": checks,
        **options,
    }


# fmt: off
CASES = [
    *[
        case(f"psm_one_doc_seed{seed}", [STACK], seed, 1.0, 0.0, (all_psm, truncated),
             "one document, always FIM, always PSM; the output is truncated to the input length")
        for seed in (1, 2, 3)
    ],
    *[
        case(f"spm_one_doc_seed{seed}", [COUNT], seed, 1.0, 1.0, (all_spm, truncated),
             "one document, always FIM, always SPM; the output is truncated to the input length")
        for seed in (4, 5)
    ],
    *[
        case(f"three_docs_seed{seed}", [ADD, EOD, FOX, EOD, READ], seed, 1.0, 0.5,
             (all_permuted, psm_and_spm, truncated),
             "three documents separated by EOD, each permuted on its own, PSM or SPM by draw")
        for seed in (6, 7, 9)
    ],
    *[
        case(f"four_docs_rate_half_seed{seed}", [PROSE, EOD, ADD, EOD, IMPORT_PATH, EOD, FOX],
             seed, 0.5, 0.5, (some_permuted_some_not,),
             "fim_rate 0.5 over four documents: some permuted, some left as they are")
        for seed in (11, 12, 13, 14)
    ],
    case("split_fragments_rate1", REPO, 21, 1.0, 0.5, (all_permuted, truncated),
         "split on <file_sep>: every file permuted on its own, <file_sep> kept between them",
         **SPLIT, fim_fragment_rate=1.0),
    *[
        case(f"split_fragments_rate_half_seed{seed}", REPO_B, seed, 1.0, 0.5,
             (some_permuted_some_not,),
             "split on <file_sep>, fim_fragment_rate 0.5: some files permuted, some not",
             **SPLIT, fim_fragment_rate=0.5)
        for seed in (22, 23)
    ],
    case("split_with_eod", REPO_TWO_DOCS, 24, 1.0, 0.5, (all_permuted,),
         "split mode over two documents: split on EOD first, then each document on <file_sep>",
         **SPLIT, fim_fragment_rate=1.0),
    case("split_sample_not_chosen", REPO_TWO_DOCS, 17, 0.5, 0.5, (split_document_kept,),
         "split mode, fim_rate 0.5: the per-document draw says no, that document is kept whole",
         **SPLIT, fim_fragment_rate=1.0),
    case("split_no_file_sep", [STACK], 26, 1.0, 0.5, (all_permuted, truncated),
         "split mode on a sample without <file_sep>: permuted as a whole with fim_rate",
         **SPLIT, fim_fragment_rate=0.0),
    case("no_prefix_import", [IMPORTS, EOD, ADD, EOD, IMPORT_PATH], 31, 1.0, 0.5,
         (some_kept_for_prefix,),
         "fim_no_prefix 'import': the documents starting with it are kept, the other permuted",
         fim_no_prefix="import"),
    case("no_prefix_import_split", [FILE_INIT, FILE_SEP, FILE_CLI, FILE_SEP, FILE_MAIN], 32,
         1.0, 0.5, (some_kept_for_prefix,),
         "fim_no_prefix 'import' in split mode: the file starting with it is kept",
         **SPLIT, fim_fragment_rate=1.0, fim_no_prefix="import"),
    case("non_ascii_code_points", [GREET, EOD, PROSE], 61, 1.0, 0.5,
         (all_permuted, boundary_past_non_ascii),
         "non-ASCII text: the boundaries index characters (code points), not bytes or tokens"),
    case("padded_special_tokens_dropped", REPO_FIVE_SEPS, 37, 1.0, 0.5, (padded,),
         "no split mode: decoding drops the five <file_sep>; the output is short, padded"),
]

EDGE_CASES = [
    case("eod_at_start", [EOD, STACK], 51, 1.0, 0.0, (all_permuted,),
         "EOD at position 0: the empty segment before it is skipped and that EOD is dropped"),
    case("adjacent_eods", [ADD, EOD, EOD, FOX], 52, 1.0, 0.5, (all_permuted,),
         "two adjacent EODs: the empty segment between them is skipped, the second EOD dropped"),
    case("trailing_eod", [COUNT, EOD], 53, 1.0, 0.0, (empty_permuted, truncated),
         "sample ending with EOD: the empty last segment is permuted; truncation cuts it off"),
    case("trailing_eod_sentinels_visible", [*REPO_SEVEN_SEPS, EOD], 15, 1.0, 0.0,
         (empty_sentinels_visible,),
         "sample ending with EOD after a shrinking segment: the empty segment's sentinels show"),
    case("split_adjacent_file_seps",
         [FILE_README, FILE_SEP, FILE_SEP, FILE_INIT, FILE_SEP, FILE_CLI], 55, 1.0, 0.5,
         (all_permuted,),
         "split mode, two adjacent <file_sep>: the empty fragment is skipped, the second dropped",
         **SPLIT, fim_fragment_rate=1.0),
    case("split_file_sep_at_start", [FILE_SEP, FILE_MAIN, FILE_SEP, FILE_TEST], 56, 1.0, 0.5,
         (all_permuted,),
         "split mode, <file_sep> at position 0: the empty fragment is skipped, that token dropped",
         **SPLIT, fim_fragment_rate=1.0),
    case("split_file_sep_before_eod", [FILE_TEST, FILE_SEP, EOD, FOX], 57, 1.0, 0.5,
         (empty_sentinels_visible,),
         "split mode, document ending with <file_sep>: its empty last fragment gets the sentinels",
         **SPLIT, fim_fragment_rate=1.0),
]
# fmt: on


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def well_formed(sample, separator):
    """No separator first or last, and no two in a row."""
    return (
        bool(sample)
        and sample[0] != separator
        and sample[-1] != separator
        and all(not (a == b == separator) for a, b in itertools.pairwise(sample))
    )


def segments(sample, separator):
    out, current = [], []
    for token in sample:
        if token == separator:
            out.append(current)
            current = []
        else:
            current.append(token)
    out.append(current)
    return out


def run_case(backend, ids, spec, edge):
    """Run Megatron on one case, check what its note claims, and return its record."""
    name = spec["name"]
    sample = sample_ids(backend, spec["pieces"])
    if not 40 <= len(sample) <= 120:
        sys.exit(f"case {name}: {len(sample)} ids, not 40 to 120")
    if not edge:
        # Regular cases keep clear of the edge cases' separator placements.
        separators = [ids["eod"]]
        if spec["fim_split_sample"] is not None:
            separators.append(ids["file_sep"])
        if not well_formed(sample, ids["eod"]) or not all(
            well_formed(segment, separators[-1]) for segment in segments(sample, ids["eod"])
        ):
            sys.exit(f"case {name}: a separator at an end or two in a row")
    settings = {key: spec[key] for key in SETTINGS}
    run = run_megatron(backend, sample, **settings)
    failed = [check.__name__ for check in spec["checks"] if not check(run, sample, ids)]
    if failed:
        sys.exit(f"case {name}: the output does not show {', '.join(failed)}")
    return {
        "name": name,
        **settings,
        "sample": sample,
        "output": run.output,
        "draws": run.draws,
        "note": spec["note"],
    }


def to_json(data) -> str:
    """Indented JSON, with each case's fields one to a line and lists on one line."""

    def members(mapping, indent):
        return ",\n".join(f"{indent}{json.dumps(k)}: {v}" for k, v in mapping.items())

    def record(mapping):
        fields = {key: json.dumps(value) for key, value in mapping.items()}
        return "    {\n" + members(fields, "      ") + "\n    }"

    top = {}
    for key, value in data.items():
        if isinstance(value, list):
            top[key] = "[\n" + ",\n".join(record(r) for r in value) + "\n  ]"
        else:
            top[key] = json.dumps(value)
    return "{\n" + members(top, "  ") + "\n}\n"


def main():
    build_tokenizer().save(str(TOKENIZER_PATH), pretty=True)
    # Run the cases with the tokenizer as read back from the file the tests will use.
    backend = Tokenizer.from_file(str(TOKENIZER_PATH))
    assert backend.get_vocab_size() == VOCAB_SIZE
    ids = {
        name: backend.token_to_id(token)
        for name, token in (
            ("eod", EOD), ("prefix", PREFIX), ("middle", MIDDLE),
            ("suffix", SUFFIX), ("pad", PAD), ("file_sep", FILE_SEP),
        )
    }  # fmt: skip
    data = {
        "megatron_core_version": version("megatron-core"),
        "numpy_version": np.__version__,
        "tokens": ids,
        "cases": [run_case(backend, ids, case, edge=False) for case in CASES],
        "edge_cases": [run_case(backend, ids, case, edge=True) for case in EDGE_CASES],
    }
    names = [c["name"] for c in data["cases"] + data["edge_cases"]]
    assert len(names) == len(set(names))
    CASES_PATH.write_text(to_json(data))
    print(
        f"wrote {TOKENIZER_PATH.name} and {CASES_PATH.name}: "
        f"{len(data['cases'])} cases, {len(data['edge_cases'])} edge cases"
    )


if __name__ == "__main__":
    main()
