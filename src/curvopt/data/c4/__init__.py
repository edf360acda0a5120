"""C4 (English) for LLaMA pretraining with the GaLore protocol the RACS/Alice paper follows.

What GaLore's ``torchrun_main.py`` does, and what this module reproduces (docs/alice_llm.md,
"Pipeline"):

* documents from ``allenai/c4`` ``en`` (train / validation), streamed and ``shuffle(seed=42)``;
* the ``t5-base`` tokenizer, ``max_length`` 256, **one document per sequence**, truncated and
  right-padded to ``max_length`` (pad id 0; the tokenizer appends ``</s>``);
* labels = input ids with padding set to −100;
* evaluation on about 10M non-pad validation tokens.

Sources, in the order tried by ``source=auto``:

1. local JSON-lines files under ``<data_dir>/c4/``: ``{train,validation}.jsonl[.gz]`` /
   ``.json[.gz]`` or the original shard names ``[en/]c4-{split}.*.json.gz`` (read through HF
   ``datasets`` in streaming mode, so the same shuffling and sharding code serves both);
2. the hub (``allenai/c4``), when the process is online.

The tokenizer comes from ``<data_dir>/tokenizers/<name>`` when that directory exists, else from
the hub. With neither data nor network the loader stops before training with a message that says
which files to put where.

Two ways to feed the loop:

* **in memory** (quick profile): tokenised sequences become ``DataBundle.train = (x, y)``;
* **streaming** (paper scale, ``streaming=true``): ``DataBundle.train_stream`` is a
  :class:`C4TrainStream` that tokenises in a background thread, shards documents across
  data-parallel ranks (``datasets.distributed.split_dataset_by_node``) and checkpoints its
  position (documents read + tokens not yet emitted), so a resumed run sees the same sequences.

``x`` holds input ids ``(N, T)``; ``y = labels[:, 1:]`` (next-token targets, −100 on padding),
shape ``(N, T−1)``, which :class:`curvopt.models.causal_lm.CausalLM` aligns with its logits.

Flags beyond GaLore: ``packing`` (concatenate documents, each ending in ``</s>``, and cut into
full ``max_length`` windows: no padding, no truncation loss) and ``vocab_limit`` (quick profile
only: keep the ``vocab_limit − 3`` most frequent training-token ids plus pad/eos/unk and map the
rest to ``<unk>``, so a CPU model does not spend 90 % of its time in a 32k-way softmax; the
fraction of tokens mapped to ``<unk>`` is recorded in ``meta``).

The package's modules, in pipeline order: :mod:`~curvopt.data.c4.sources` (local files or the
hub, and the errors that say what to put where), :mod:`~curvopt.data.c4.tokenizer`,
:mod:`~curvopt.data.c4.sequences` (padding, packing, labels, the compact vocabulary),
:mod:`~curvopt.data.c4.stream` (:class:`C4TrainStream`) and :mod:`~curvopt.data.c4.loader`
(:func:`load_c4`, the dataset target). Everything public is importable from ``curvopt.data.c4``.
"""

from curvopt.data.c4.loader import load_c4
from curvopt.data.c4.sequences import (
    IGNORE_INDEX,
    VocabMap,
    encode_documents,
    encode_padded,
    next_token_labels,
    pack,
    tokenize_split,
)
from curvopt.data.c4.sources import (
    HUB_DATASET,
    SPLIT_NAMES,
    corrupt_c4,
    document_dataset,
    is_offline,
    iter_texts,
    local_files,
)
from curvopt.data.c4.stream import C4TrainStream
from curvopt.data.c4.tokenizer import HUB_TOKENIZERS, TOKENIZER_FILES, load_tokenizer

__all__ = [
    "HUB_DATASET",
    "HUB_TOKENIZERS",
    "IGNORE_INDEX",
    "SPLIT_NAMES",
    "TOKENIZER_FILES",
    "C4TrainStream",
    "VocabMap",
    "corrupt_c4",
    "document_dataset",
    "encode_documents",
    "encode_padded",
    "is_offline",
    "iter_texts",
    "load_c4",
    "load_tokenizer",
    "local_files",
    "next_token_labels",
    "pack",
    "tokenize_split",
]
