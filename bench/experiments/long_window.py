"""ModernBERT's long window through the service: a random-weight ModernBERT classifier of 8,192
positions exported with `--max-seq-len 8192`, served over HTTP, asked about texts of about 1k,
4k and 8k tokens: each answer against the transformers pipeline of the same checkpoint, the
time of each, and what a text past the window gets (413; `long_input: chunk`).

    bertserve bench long-window [--hidden 128] [--layers 6] [--out FILE]

The weights are random (no hub here): the answers' values mean nothing, their equality with the
pipeline's and the times do.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import transformers
from tokenizers import ByteLevelBPETokenizer, processors

SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
PROSE = (
    "the river ran past the old mill and the town grew along its banks while traders came "
    "from the north with salt and cloth and the bridge was built in stone after the flood"
)
WORDS = PROSE.split(" ")


def checkpoint(root: Path, hidden: int, layers: int) -> Path:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS)] * 20, vocab_size=300, special_tokens=SPECIALS)
    ids = {t: bpe.token_to_id(t) for t in SPECIALS}
    bpe.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "attention_mask"],
    )
    config = transformers.ModernBertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        max_position_embeddings=8192,
        pad_token_id=ids["[PAD]"],
        cls_token_id=ids["[CLS]"],
        sep_token_id=ids["[SEP]"],
        bos_token_id=ids["[CLS]"],
        eos_token_id=ids["[SEP]"],
        id2label={0: "negative", 1: "positive"},
        label2id={"negative": 0, "positive": 1},
    )
    directory = root / "modernbert-8k"
    transformers.ModernBertForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def text_of(tokens: int, tokenizer) -> str:
    words, text = [], ""
    while len(tokenizer(text)["input_ids"]) < tokens:
        words.extend(WORDS)
        text = " ".join(words)
    while len(tokenizer(text)["input_ids"]) > tokens:
        words.pop()
        text = " ".join(words)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from bertserve.export.bundle import build_bundle

    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores. Command: `bertserve bench "
        f"long-window --hidden {args.hidden} --layers {args.layers}`: a random-weight "
        f"ModernBERT classifier, {args.layers} x {args.hidden}, 8,192 positions, local window "
        "128, exported with `--max-seq-len 8192`, one worker.",
        "",
        "| text | tokens | answer = pipeline's (max abs diff of the scores) | service ms | "
        "pipeline ms |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-long-window-") as tmp:
        root = Path(tmp)
        source = checkpoint(root, args.hidden, args.layers)
        build_bundle(source, ["classify"], root / "bundles" / "modernbert-8k", max_seq_len=8192)
        env = os.environ | {"BERTSERVE_WORKERS": "1", "BERTSERVE_LOG_LEVEL": "warning"}
        command = [sys.executable, "-m", "bertserve.service", "--bundles", str(root / "bundles")]
        server = subprocess.Popen([*command, "--port", str(args.port)], env=env)
        url = f"http://127.0.0.1:{args.port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{url}/health/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("the service did not become ready")
                time.sleep(0.2)
            model = transformers.ModernBertForSequenceClassification.from_pretrained(source)
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
            pipe = transformers.pipeline(
                "text-classification", model=model, tokenizer=tokenizer, device="cpu"
            )
            with httpx.Client(base_url=url, timeout=300) as client:
                for tokens in (1024, 4096, 8192):
                    text = text_of(tokens, tokenizer)
                    started = time.perf_counter()
                    response = client.post("/classify", json={"inputs": text})
                    ours_ms = 1000 * (time.perf_counter() - started)
                    assert response.status_code == 200, response.text
                    ours = response.json()
                    started = time.perf_counter()
                    theirs = pipe(text, top_k=None)
                    theirs_ms = 1000 * (time.perf_counter() - started)
                    score = {x["label"]: x["score"] for x in theirs}
                    diff = max(abs(x["score"] - score[x["label"]]) for x in ours)
                    same = ours[0]["label"] == theirs[0]["label"] and diff < 1e-4
                    line = (
                        f"| {tokens:,} tokens | {len(tokenizer(text)['input_ids']):,} | "
                        f"{'yes' if same else 'NO'} ({diff:.1e}) | {ours_ms:,.0f} | "
                        f"{theirs_ms:,.0f} |"
                    )
                    lines.append(line)
                    print(line, flush=True)
                longer = text_of(8192, tokenizer) + " " + " ".join(WORDS * 20)
                refused = client.post("/classify", json={"inputs": longer})
                chunked = client.post(
                    "/classify",
                    json={"inputs": longer, "parameters": {"long_input": "chunk"}},
                )
                lines += [
                    "",
                    f"A text of {len(tokenizer(longer)['input_ids']):,} tokens: "
                    f"{refused.status_code} (`{refused.json()['error'][:80]}...`); with "
                    f"`long_input: chunk`: {chunked.status_code}.",
                ]
        finally:
            server.terminate()
            server.wait(timeout=60)
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
