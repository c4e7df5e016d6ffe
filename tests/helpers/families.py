"""Tiny checkpoints of the other encoder families, each with a tokenizer of its own kind built
here (no hub): RoBERTa with byte-level BPE, XLM-RoBERTa with a SentencePiece Unigram, DistilBERT
and ELECTRA with WordPiece. Saved as `save_pretrained` writes them: config.json,
model.safetensors, tokenizer.json, special_tokens_map.json, tokenizer_config.json."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import ByteLevelBPETokenizer, SentencePieceUnigramTokenizer, processors

from tests.helpers.checkpoints import write_vocab

CORPUS = [
    "The film was good, and the cast was great.",
    "Who was the first king of France? He was born in Paris.",
    "A dull movie, a bad year: the dog and the fox went to London.",
    "Paris is the first city of France. The river of Paris was good.",
    "Angela Merkel met Jean-Luc in Berlin; O'Neill stayed in New York.",
    "Aristotle was born in Stagira in 384 BC and studied at Plato's Academy in Athens.",
    "Café au lait costs 3,50 € in Zürich — naïve prices!",
]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0..4: <pad> = 1
NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
TASK_HEADS = {
    "classify": "ForSequenceClassification",
    "ner": "ForTokenClassification",
    "qa": "ForQuestionAnswering",
    "fill-mask": "ForMaskedLM",
    "rerank": "ForSequenceClassification",  # one output: a cross-encoder
    "embed": "Model",
}
CLASSES = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "distilbert": "DistilBert"}
CLASSES["electra"] = "Electra"
CLASSES["modernbert"] = "ModernBert"
CLASSES["deberta-v2"] = "DebertaV2"
# ModernBERT's tokenizer: byte-level BPE with BERT's special tokens and templates.
MODERNBERT_SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]


def tokenizer(family: str, directory: Path) -> transformers.PreTrainedTokenizerFast:
    directory.mkdir(parents=True, exist_ok=True)
    if family == "roberta":
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(CORPUS * 4, vocab_size=400, special_tokens=ROBERTA_SPECIALS)
        bpe.save_model(str(directory))
        return transformers.RobertaTokenizerFast(
            str(directory / "vocab.json"), str(directory / "merges.txt")
        )
    if family == "xlm-roberta":
        unigram = SentencePieceUnigramTokenizer()
        unigram.train_from_iterator(
            CORPUS * 4, vocab_size=200, special_tokens=ROBERTA_SPECIALS, unk_token="<unk>"
        )
        ids = {t: unigram.token_to_id(t) for t in ROBERTA_SPECIALS}
        unigram.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>",
            pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])],
        )
        return transformers.XLMRobertaTokenizerFast(
            tokenizer_object=unigram._tokenizer,
            bos_token="<s>",
            eos_token="</s>",
            sep_token="</s>",
            cls_token="<s>",
            unk_token="<unk>",
            pad_token="<pad>",
            mask_token="<mask>",
        )
    if family == "deberta-v2":  # v3's: a SentencePiece Unigram in BERT's special tokens
        unigram = SentencePieceUnigramTokenizer()
        unigram.train_from_iterator(
            CORPUS * 4,
            vocab_size=200,
            special_tokens=["[PAD]", "[CLS]", "[SEP]", "[UNK]"],
            unk_token="[UNK]",
        )
        unigram.add_special_tokens(["[MASK]"])  # at the end, as deberta-v3's
        ids = {t: unigram.token_to_id(t) for t in ("[CLS]", "[SEP]")}
        unigram.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
        )
        return transformers.DebertaV2TokenizerFast(
            tokenizer_object=unigram._tokenizer,
            bos_token="[CLS]",
            eos_token="[SEP]",
            unk_token="[UNK]",
            sep_token="[SEP]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            mask_token="[MASK]",
        )
    if family == "modernbert":
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(CORPUS * 4, vocab_size=400, special_tokens=MODERNBERT_SPECIALS)
        ids = {t: bpe.token_to_id(t) for t in MODERNBERT_SPECIALS}
        bpe.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
        )
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=bpe._tokenizer,
            unk_token="[UNK]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            pad_token="[PAD]",
            mask_token="[MASK]",
            model_input_names=["input_ids", "attention_mask"],
        )
    write_vocab(directory / "vocab.txt")
    cls = transformers.DistilBertTokenizerFast if family == "distilbert" else None
    cls = cls or transformers.ElectraTokenizerFast
    return cls(vocab_file=str(directory / "vocab.txt"))


def config(family: str, task: str, vocab: int, pad: int) -> transformers.PretrainedConfig:
    labels = {"classify": ["negative", "positive", "neutral"], "ner": NER_LABELS}.get(task)
    extra = (
        {"id2label": dict(enumerate(labels)), "label2id": {v: i for i, v in enumerate(labels)}}
        if labels
        else {}
    )
    extra |= {"num_labels": 1} if task == "rerank" else {}
    shape = {"vocab_size": vocab, "pad_token_id": pad, "max_position_embeddings": 130} | extra
    if family == "distilbert":
        return transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=37, **shape)
    if family == "deberta-v2":  # v3's layout; buckets closer than the QA windows
        return transformers.DebertaV2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            relative_attention=True,
            position_buckets=16,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            position_biased_input=False,
            type_vocab_size=0,
            **shape,
        )
    if family == "modernbert":  # layer 0 global, 1 and 2 local: a window of 8 either way
        return transformers.ModernBertConfig(
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=37,
            local_attention=16,
            global_rope_theta=1000.0,
            local_rope_theta=100.0,
            cls_token_id=1,
            sep_token_id=2,
            bos_token_id=1,
            eos_token_id=2,
            **shape,
        )
    body = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    body |= {"intermediate_size": 37}
    if family == "electra":
        return transformers.ElectraConfig(**body, embedding_size=16, **shape)
    cls = transformers.RobertaConfig if family == "roberta" else transformers.XLMRobertaConfig
    return cls(**body, type_vocab_size=1, **shape)


def family_checkpoint(root: Path, family: str, task: str, seed: int = 0) -> Path:
    """A random checkpoint of `family` with the head `task` needs, its heads spread (x20; x4
    for ModernBERT, whose head normalises before its classifier) so that argmax comparisons
    mean something without saturating scores to float32 ties, and its tokenizer."""
    directory = root / f"{family}-{task}"
    tok = tokenizer(family, directory / "tok")
    torch.manual_seed(seed)
    cls = getattr(transformers, CLASSES[family] + TASK_HEADS[task])
    model = cls(config(family, task, len(tok), tok.pad_token_id)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("classifier", "qa_outputs", "pre_classifier")):
                param.mul_(4 if family in ("modernbert", "deberta-v2") else 20)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    if task == "embed":  # a sentence-transformers directory: mean pooling, normalised
        from sentence_transformers import SentenceTransformer, models

        encoder = models.Transformer(str(directory))
        pooling = models.Pooling(encoder.get_word_embedding_dimension(), "mean")
        SentenceTransformer(modules=[encoder, pooling, models.Normalize()]).save(str(directory))
    return directory
