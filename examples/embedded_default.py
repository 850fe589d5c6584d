"""The embedded default: a corpus, tokenizers and tiny model configs that exist on every machine.

Every example script runs with no data or model arguments, offline, on what this module builds:

* **Corpus.** The docstrings of the installed Python standard library, then of the installed
  packages (site-packages), extracted with `ast` (nothing is imported or executed). Files are
  visited in a fixed pseudo-random order (sorted by a hash of their relative path), so any size
  cap takes an even sample of the library instead of its alphabetical head. The corpus is cut at
  ``STRONGHOLD_EXAMPLES_CORPUS_BYTES`` bytes (default 3 MB; the tests use far less).
* **Splits.** Each docstring goes to ``validation`` when a hash of its name falls in a 5% bucket,
  otherwise to ``train``; the split is stable across runs and machines.
* **Tokenizers**, trained locally with `tokenizers` on the train split and wrapped in
  `PreTrainedTokenizerFast`: byte-level BPE for GPT, WordPiece with ``[PAD] [UNK] [CLS] [SEP]
  [MASK]`` for BERT, and Unigram with ``<pad> </s> <unk>`` plus the sentinels ``<extra_id_0>`` ...
  ``<extra_id_99>`` for T5.
* **Configs** for tiny GPT-2, BERT and T5 models (4 layers, width 128) that train in minutes on
  two CPU cores.
* **A downstream task** for `run_glue.py`: docstring topic classification (see
  `topic_classification_files`).

Everything is cached under ``STRONGHOLD_EXAMPLES_CACHE`` (default
``~/.cache/stronghold_hf/examples``), keyed by the corpus cap, the vocabulary size and the Python
version. Writes are atomic (temporary name, then rename), so several processes of one
``accelerate launch`` may build the same asset at once without corrupting it.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Literal, Sequence

logger = logging.getLogger(__name__)

CACHE_ENV = "STRONGHOLD_EXAMPLES_CACHE"
CORPUS_BYTES_ENV = "STRONGHOLD_EXAMPLES_CORPUS_BYTES"
DEFAULT_CORPUS_BYTES = 3_000_000
DEFAULT_VOCAB_SIZE = 8192
#: Bump when the extraction or the file formats change, so stale caches are not reused.
FORMAT_VERSION = 1
VALIDATION_PERCENT = 5
#: The topic task holds out more (20%) so that its accuracy is measured on a few hundred rows.
TOPIC_VALIDATION_PERCENT = 20

TokenizerKind = Literal["gpt", "bert", "t5"]

# Directories that hold tests, demos or vendored copies rather than library documentation.
_SKIP_DIRS = {
    "__pycache__", "site-packages", "dist-packages", "test", "tests", "testing", "idlelib",
    "lib2to3", "turtledemo", "_vendor", "vendor", "examples", "benchmarks",
}


# --------------------------------------------------------------------------------------- corpus
@dataclass(frozen=True)
class Docstring:
    """One docstring of the corpus."""

    module: str
    """Dotted module name, e.g. ``"email.message"`` (site-packages modules keep their package)."""
    qualname: str
    """``""`` for a module docstring, else e.g. ``"Message.get_payload"``."""
    kind: str
    """``"module"``, ``"class"`` or ``"function"``."""
    text: str
    """The cleaned docstring: paragraphs separated by ``"\\n"``, each on one line."""

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def split(self) -> str:
        return "validation" if _bucket(self.key) < VALIDATION_PERCENT else "train"


def _bucket(key: str, buckets: int = 100) -> int:
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:4], "big") % buckets


def cache_dir() -> Path:
    """The cache directory of the embedded assets (``$STRONGHOLD_EXAMPLES_CACHE``)."""
    path = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "stronghold_hf" / "examples")
    path.mkdir(parents=True, exist_ok=True)
    return path


def corpus_bytes_cap() -> int:
    """The corpus size cap in bytes (``$STRONGHOLD_EXAMPLES_CORPUS_BYTES``, default 3 MB)."""
    raw = os.environ.get(CORPUS_BYTES_ENV)
    if not raw:
        return DEFAULT_CORPUS_BYTES
    try:
        value = int(float(raw))
    except ValueError:
        raise ValueError(f"{CORPUS_BYTES_ENV}={raw!r} is not a number of bytes, e.g. 3000000.") from None
    if value < 10_000:
        raise ValueError(f"{CORPUS_BYTES_ENV}={value} is too small to train a tokenizer; use at least 10000.")
    return value


def _source_files() -> list[tuple[str, Path]]:
    """(module name, path) of every .py file: the stdlib first, then site-packages; each hash-ordered."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"]]
    roots += [p for p in dict.fromkeys((paths.get("purelib"), paths.get("platlib"))) if p and os.path.isdir(p)]
    found: list[tuple[str, Path]] = []
    seen: set[str] = set()
    for root in roots:
        group = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(
                d for d in dirnames if d not in _SKIP_DIRS and not d.endswith((".dist-info", ".egg-info"))
            )
            for name in filenames:
                if not name.endswith(".py") or name.startswith(("test_", "conftest")):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
                if module in seen:
                    continue
                seen.add(module)
                group.append((module, Path(dirpath, name)))
        group.sort(key=lambda item: hashlib.sha1(item[0].encode("utf-8")).hexdigest())
        found += group
    return found


def _clean(doc: str) -> str:
    """Joins each paragraph of a docstring onto one line and collapses whitespace."""
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", doc))
    return "\n".join(p for p in paragraphs if p)


def extract_docstrings(source: str, module: str) -> list[Docstring]:
    """The module, class and function docstrings of one source file, in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out: list[Docstring] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = f"{prefix}{child.name}"
                doc = ast.get_docstring(child)
                if doc:
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    out.append(Docstring(module, qualname, kind, _clean(doc)))
                visit(child, qualname + ".")

    doc = ast.get_docstring(tree)
    if doc:
        out.append(Docstring(module, "", "module", _clean(doc)))
    visit(tree, "")
    # Three words or fewer ("Return self.") carry no language to learn.
    return [d for d in out if len(d.text.split()) > 3]


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _atomic_write_csv(path: Path, header: list[str], rows: Iterable[Sequence[str]]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
    os.replace(tmp, path)


def _split_csv_paths(task: str) -> dict[str, Path]:
    """The ``train``/``validation`` CSV paths of a cached task folder (the folder is created)."""
    out_dir = cache_dir() / task
    out_dir.mkdir(exist_ok=True)
    return {split: out_dir / f"{split}.csv" for split in ("train", "validation")}


def load_corpus(max_bytes: int | None = None) -> list[Docstring]:
    """The docstring corpus, capped at ``max_bytes`` of text (default: `corpus_bytes_cap`), cached."""
    max_bytes = max_bytes or corpus_bytes_cap()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-{max_bytes}-v{FORMAT_VERSION}"
    path = cache_dir() / f"corpus-{tag}.jsonl"
    if path.exists():
        with open(path, encoding="utf-8") as fh:
            return [Docstring(**json.loads(line)) for line in fh]
    logger.info("Building the embedded docstring corpus (%d bytes) into %s", max_bytes, path)
    docs: list[Docstring] = []
    total = 0
    for module, file in _source_files():
        try:
            source = file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for doc in extract_docstrings(source, module):
            docs.append(doc)
            total += len(doc.text.encode("utf-8"))
        if total >= max_bytes:
            break
    _atomic_write_text(path, "".join(json.dumps(asdict(d)) + "\n" for d in docs))
    return docs


def text_files() -> dict[str, str]:
    """``{"train": path, "validation": path}``: the corpus as text files, one paragraph per line.

    These are ordinary ``--train_file``/``--validation_file`` inputs, so the embedded run goes
    through the same loading code as a user's own text files.
    """
    docs = load_corpus()
    out_dir = cache_dir() / f"text-{corpus_bytes_cap()}-v{FORMAT_VERSION}"
    out_dir.mkdir(exist_ok=True)
    files = {}
    for split in ("train", "validation"):
        path = out_dir / f"{split}.txt"
        if not path.exists():
            _atomic_write_text(path, "".join(d.text + "\n" for d in docs if d.split == split))
        files[split] = str(path)
    return files


def iter_paragraphs(split: str = "train") -> Iterator[str]:
    for doc in load_corpus():
        if doc.split == split:
            yield from doc.text.split("\n")


# ----------------------------------------------------------------------------------- tokenizers
def _train_tokenizer(kind: TokenizerKind, texts: Iterable[str], vocab_size: int):
    """Trains a `tokenizers.Tokenizer` and returns it wrapped in `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "gpt":
        eos = "<|endoftext|>"
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=eos, eos_token=eos, unk_token=eos, model_max_length=1024
        )
    if kind == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        tok.train_from_iterator(texts, trainer=trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
            sep_token="[SEP]", mask_token="[MASK]", model_max_length=512,
        )
    if kind == "t5":
        # Same id layout as T5's SentencePiece vocabulary: <pad>=0, </s>=1, <unk>=2, which is what
        # T5Config's defaults (pad_token_id=0, eos_token_id=1, decoder_start_token_id=0) expect.
        sentinels = [f"<extra_id_{i}>" for i in range(100)]
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"
        )
        tok.train_from_iterator(texts, trainer=trainer)
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
        )
        # The sentinels are appended after the learned pieces, as in T5's own vocabulary.
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
            extra_special_tokens=sentinels, model_max_length=512,
        )
    raise ValueError(f"Unknown tokenizer kind {kind!r}; use 'gpt', 'bert' or 't5'.")


def tokenizer_dir(kind: TokenizerKind, vocab_size: int = DEFAULT_VOCAB_SIZE) -> str:
    """Trains (once) and caches the embedded tokenizer of ``kind``; returns its directory.

    Load it with ``AutoTokenizer.from_pretrained(path)``.
    """
    final = cache_dir() / f"tokenizer-{kind}-{corpus_bytes_cap()}-{vocab_size}-v{FORMAT_VERSION}"
    if (final / "tokenizer.json").exists():
        return str(final)
    logger.info("Training the embedded %s tokenizer (vocab %d) into %s", kind, vocab_size, final)
    tokenizer = _train_tokenizer(kind, iter_paragraphs("train"), vocab_size)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=final.name + ".tmp"))
    tokenizer.save_pretrained(str(tmp))
    try:
        os.rename(tmp, final)
    except OSError:  # another process got there first; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


# -------------------------------------------------------------------------------------- configs
def default_config(kind: TokenizerKind, tokenizer, **overrides):
    """A tiny model config of ``kind`` sized for ``tokenizer``; ``overrides`` are constructor arguments.

    4 layers of width 128: a few hundred steps on two CPU cores visibly lower the loss. The
    overrides go to the constructor, so derived values follow them (T5's decoder has
    ``num_layers`` layers unless ``num_decoder_layers`` is given).
    """
    from transformers import BertConfig, GPT2Config, T5Config

    vocab_size = len(tokenizer)
    if kind == "gpt":
        config_class, init = GPT2Config, dict(
            vocab_size=vocab_size, n_positions=256, n_embd=128, n_layer=4, n_head=4,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )
    elif kind == "bert":
        config_class, init = BertConfig, dict(
            vocab_size=vocab_size, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=512, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        )
    elif kind == "t5":
        config_class, init = T5Config, dict(
            vocab_size=vocab_size, d_model=128, d_kv=32, d_ff=512, num_layers=4, num_heads=4,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    else:
        raise ValueError(f"Unknown model kind {kind!r}; use 'gpt', 'bert' or 't5'.")
    return config_class(**{**init, **overrides})


# ---------------------------------------------------------------------------- downstream task
#: The two topics of the default `run_glue.py` task, as top-level stdlib modules/packages.
TOPICS: dict[str, tuple[str, ...]] = {
    "concurrency": (
        "asyncio", "concurrent", "multiprocessing", "threading", "_threading_local", "subprocess",
        "queue", "selectors", "sched", "signal", "contextvars",
    ),
    "internet": (
        "email", "http", "urllib", "smtplib", "imaplib", "poplib", "ftplib", "nntplib", "mailbox",
        "mimetypes", "socketserver", "xmlrpc", "wsgiref", "cgi", "cgitb", "webbrowser", "telnetlib",
        "html", "ipaddress", "mailcap", "netrc", "smtpd", "ssl", "socket",
    ),
}
TOPIC_MAX_WORDS = 64


def _topic_docstrings() -> list[tuple[str, Docstring]]:
    """(topic, docstring) for every docstring of the `TOPICS` packages of the installed stdlib."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for topic, packages in TOPICS.items():
        for package in packages:
            if (stdlib / f"{package}.py").is_file():
                files = [(package, stdlib / f"{package}.py")]
            elif (stdlib / package).is_dir():
                files = []
                for dirpath, dirnames, filenames in os.walk(stdlib / package):
                    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
                    for name in sorted(filenames):
                        if name.endswith(".py"):
                            rel = Path(dirpath, name).relative_to(stdlib).with_suffix("")
                            files.append((".".join(rel.parts).removesuffix(".__init__"), Path(dirpath, name)))
            else:  # removed from this Python version (cgi, telnetlib, ... in 3.13)
                continue
            for module, file in files:
                source = file.read_text(encoding="utf-8", errors="replace")
                out += [(topic, doc) for doc in extract_docstrings(source, module)]
    return out


def topic_classification_files() -> dict[str, str]:
    """``{"train": csv, "validation": csv}`` for the default `run_glue.py` task.

    **Task: docstring topic.** Each row is a stdlib docstring (its first ``TOPIC_MAX_WORDS``
    words) in column ``sentence``; ``label`` says whether it comes from a concurrency module
    (asyncio, threading, multiprocessing, subprocess, ...) or an internet module (email, http,
    urllib, smtplib, ...), see `TOPICS`. The vocabulary of the two families differs (threads,
    locks, futures, event loops versus headers, messages, URLs, servers), so a small model learns
    it well above the 50% of chance. The classes are balanced by down-sampling the larger one
    (fixed seed), so accuracy is directly comparable to 0.5. The split is a hash split
    (``TOPIC_VALIDATION_PERCENT``), so no docstring is in both.

    The rows come from all docstrings of those packages, whatever the corpus cap, so the task
    has the same size (about 1,300 rows on Python 3.11) in the tests as in the default run.
    Validation rows may also be in the pretraining corpus of `run_mlm.py`, as unlabeled text.
    """
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-v{FORMAT_VERSION}"
    paths = _split_csv_paths(f"glue-topic-{tag}")
    if all(p.exists() for p in paths.values()):
        return {k: str(v) for k, v in paths.items()}
    rows: dict[str, dict[str, list[str]]] = {s: {t: [] for t in TOPICS} for s in paths}
    for topic, doc in _topic_docstrings():
        words = doc.text.replace("\n", " ").split()
        split = "validation" if _bucket("topic:" + doc.key) < TOPIC_VALIDATION_PERCENT else "train"
        rows[split][topic].append(" ".join(words[:TOPIC_MAX_WORDS]))
    rng = random.Random(0)
    for split, by_topic in rows.items():
        n = min(len(v) for v in by_topic.values())
        if n == 0:
            raise RuntimeError(f"This Python's stdlib has no {split} docstrings for one of the topics {sorted(TOPICS)}.")
        table = [(text, topic) for topic, texts in by_topic.items() for text in rng.sample(texts, n)]
        rng.shuffle(table)
        _atomic_write_csv(paths[split], ["sentence", "label"], table)
    return {k: str(v) for k, v in paths.items()}


# ------------------------------------------------------------------------------- text-to-text task
#: The text-to-text task reads at least this much of the corpus (whatever the corpus cap), so that
#: it has about 2,000 pairs and a validation split of about 200 even when the cap is small (tests).
SUMMARY_MIN_CORPUS_BYTES = 1_000_000
SUMMARY_MAX_PAIRS = 4000
SUMMARY_VALIDATION_PERCENT = 10
SUMMARY_MAX_TARGET_WORDS = 32
SUMMARY_MIN_SOURCE_WORDS = 8
SUMMARY_MAX_SOURCE_WORDS = 96
# A sentence ends at . ! or ? followed by a space and what can start a sentence ("e.g. the" does not).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9`'\"(\[])")


def split_sentences(text: str, maxsplit: int = 0) -> list[str]:
    """``text`` cut after each ``.``, ``!`` or ``?`` that a space and a sentence start follow."""
    return _SENTENCE_END.split(text, maxsplit=maxsplit)


def first_sentence_pair(text: str) -> tuple[str, str] | None:
    """``(rest, first_sentence)`` of a cleaned docstring, or ``None`` when it makes no usable pair.

    The first sentence is the start of the first paragraph up to the first sentence end; the rest
    is everything after it, on one line, cut to `SUMMARY_MAX_SOURCE_WORDS` words.
    """
    first_paragraph, _, later = text.partition("\n")
    parts = split_sentences(first_paragraph, maxsplit=1)
    target = parts[0].strip()
    source = " ".join((parts[1:] + [later.replace("\n", " ")])).split()
    if not 3 <= len(target.split()) <= SUMMARY_MAX_TARGET_WORDS or len(source) < SUMMARY_MIN_SOURCE_WORDS:
        return None
    return " ".join(source[:SUMMARY_MAX_SOURCE_WORDS]), target


def docstring_summary_files() -> dict[str, str]:
    """``{"train": csv, "validation": csv}`` for the default `run_seq2seq.py` task, columns ``text`` and ``summary``.

    **Task: a docstring's first sentence from the rest of it.** PEP 257 docstrings open with a
    one-sentence summary ("Return the payload as a string."); the source is the docstring after
    that sentence (its details: arguments, return value, caveats), the target is the sentence.
    Pairs need a summary of 3 to `SUMMARY_MAX_TARGET_WORDS` words and at least
    `SUMMARY_MIN_SOURCE_WORDS` words of source; identical pairs are kept once, and at most
    `SUMMARY_MAX_PAIRS` are taken in corpus order. A pair goes to validation when a hash of its
    summary falls in a `SUMMARY_VALIDATION_PERCENT` % bucket, so docstrings repeated across classes
    ("Return self.") never sit in both splits.
    """
    max_bytes = max(corpus_bytes_cap(), SUMMARY_MIN_CORPUS_BYTES)
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-{max_bytes}-v{FORMAT_VERSION}"
    paths = _split_csv_paths(f"summary-{tag}")
    if all(p.exists() for p in paths.values()):
        return {k: str(v) for k, v in paths.items()}
    rows: dict[str, list[tuple[str, str]]] = {split: [] for split in paths}
    seen: set[tuple[str, str]] = set()
    for doc in load_corpus(max_bytes):
        pair = first_sentence_pair(doc.text)
        if pair is None or pair in seen:
            continue
        seen.add(pair)
        split = "validation" if _bucket("summary:" + pair[1]) < SUMMARY_VALIDATION_PERCENT else "train"
        rows[split].append(pair)
        if len(seen) >= SUMMARY_MAX_PAIRS:
            break
    for split, table in rows.items():
        if not table:
            raise RuntimeError(f"The docstring corpus gave no {split} pairs for the summary task; raise {CORPUS_BYTES_ENV}.")
        _atomic_write_csv(paths[split], ["text", "summary"], table)
    return {k: str(v) for k, v in paths.items()}
