"""Client jobs, run in the clients' own virtualenv (.venv-clients: tests/clients/requirements.txt),
never in bertserve's: each takes the server's URL and a file of texts, makes one library's
calls with that library's defaults, and prints JSON: how many vectors (or ranks) came back,
and a few of them for the test to hold against the server's own /embed answers.

    .venv-clients/bin/python tests/clients/jobs.py JOB URL TEXTS
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

SAMPLE = (0, 1, 999, 1999)  # the vectors sent back for comparison
QUERY = "who was the first king of france ?"
DOCS = ["the king of france was born in paris", "a dull movie , a bad year", "the dog and the fox"]


def vectors(got: list) -> dict:
    return {"count": len(got), "dim": len(got[0]), "sample": {i: list(got[i]) for i in SAMPLE}}


def langchain(url: str, texts: list[str]) -> dict:
    """langchain-openai's OpenAIEmbeddings with its default chunk_size (1,000 texts a request).
    Its default check_embedding_ctx_length=True sends tiktoken ids: refused with a 422 that
    says to turn it off (TIKTOKEN_CACHE_DIR points at a cl100k file a client package ships)."""
    from langchain_openai import OpenAIEmbeddings

    plain = OpenAIEmbeddings(
        base_url=f"{url}/v1", api_key="unused", check_embedding_ctx_length=False
    )
    out = vectors(plain.embed_documents(texts))
    try:
        OpenAIEmbeddings(base_url=f"{url}/v1", api_key="unused", max_retries=0).embed_documents(
            texts[:3]
        )
        out["default_mode"] = "answered"
    except Exception as exc:  # the library's own exception, as a user meets it
        out["default_mode"] = f"{type(exc).__name__}: {exc}"
    return out


def llama_openai(url: str, texts: list[str]) -> dict:
    """llama-index's OpenAIEmbedding (100 texts a request), sync and async."""
    from llama_index.embeddings.openai import OpenAIEmbedding

    model = OpenAIEmbedding(api_base=f"{url}/v1", api_key="unused")
    out = vectors(model.get_text_embedding_batch(texts))
    out["async"] = vectors(asyncio.run(model.aget_text_embedding_batch(texts)))
    return out


def llama_tei(url: str, texts: list[str]) -> dict:
    """llama-index's TextEmbeddingsInference (10 texts a request); its async batch sends every
    request at once (200 for 2,000 texts)."""
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    model = TextEmbeddingsInference(model_name="minilm-embed", base_url=url, timeout=120)
    out = vectors(model.get_text_embedding_batch(texts))
    out["async"] = vectors(asyncio.run(model.aget_text_embedding_batch(texts)))
    return out


def haystack(url: str, texts: list[str]) -> dict:
    """haystack's HuggingFaceAPIDocumentEmbedder on a text-embeddings-inference URL."""
    from haystack import Document
    from haystack_integrations.components.embedders.huggingface_api import (
        HuggingFaceAPIDocumentEmbedder,
    )

    embedder = HuggingFaceAPIDocumentEmbedder(
        api_type="text_embeddings_inference", api_params={"url": url}
    )
    documents = embedder.run(documents=[Document(content=t) for t in texts])["documents"]
    return vectors([d.embedding for d in documents])


def chroma(url: str, texts: list[str]) -> dict:
    """chromadb's HuggingFaceEmbeddingServer, which sends a whole add() in one request."""
    import chromadb
    import httpx
    from chromadb.config import Settings
    from chromadb.utils.embedding_functions import HuggingFaceEmbeddingServer

    client = chromadb.EphemeralClient(Settings(anonymized_telemetry=False))
    function = HuggingFaceEmbeddingServer(url=f"{url}/embed")
    # Its httpx client keeps httpx's 5 s default: a 2,000-text add() took longer on a 2-core
    # AVX2 EPYC (docs/api.md#client-libraries), so the job gives it what a user would.
    function._session.timeout = httpx.Timeout(60.0)
    collection = client.create_collection("sst2", embedding_function=function)
    collection.add(ids=[str(i) for i in range(len(texts))], documents=texts)
    got = collection.get(ids=[str(i) for i in SAMPLE], include=["embeddings"])
    return {
        "count": collection.count(),
        "dim": len(got["embeddings"][0]),
        "sample": {
            int(i): list(map(float, v)) for i, v in zip(got["ids"], got["embeddings"], strict=True)
        },
    }


def litellm_job(url: str, texts: list[str]) -> dict:
    """litellm's embedding through its OpenAI-compatible provider."""
    import litellm

    answer = litellm.embedding(
        model="openai/minilm-embed", api_base=f"{url}/v1", api_key="unused", input=texts
    )
    return vectors([d["embedding"] for d in answer.data])


def ranks(url: str, texts: list[str]) -> dict:
    """The rerank clients: litellm's `huggingface/` provider (TEI's /rerank, with top_n),
    haystack's HuggingFaceTEIRanker and llama-index's TEI rerank post-processor."""
    import litellm
    from haystack import Document
    from haystack_integrations.components.rankers.huggingface_api import HuggingFaceTEIRanker
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.postprocessor.tei_rerank import TextEmbeddingInference

    out = {}
    answer = litellm.rerank(
        model="huggingface/tiny-reranker", api_base=url, query=QUERY, documents=DOCS, top_n=2
    )
    out["litellm"] = [r["index"] for r in answer.results]
    ranker = HuggingFaceTEIRanker(url=url, top_k=2)
    ranked = ranker.run(query=QUERY, documents=[Document(content=d) for d in DOCS])["documents"]
    out["haystack"] = [DOCS.index(d.content) for d in ranked]
    nodes = [NodeWithScore(node=TextNode(text=d)) for d in DOCS]
    post = TextEmbeddingInference(base_url=url, top_n=2)
    kept = post.postprocess_nodes(nodes, query_str=QUERY)
    out["llama_index"] = [DOCS.index(n.node.get_content()) for n in kept]
    return out


def hub(url: str, texts: list[str]) -> dict:
    """huggingface_hub 2.x's InferenceClient.feature_extraction, which types and sends
    truncation_direction in lower case ("left", "right"), on a text past the window."""
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=url)
    long = " ".join(texts[:80])
    return {
        side: client.feature_extraction(long, truncate=True, truncation_direction=side)[0].tolist()
        for side in ("left", "right")
    } | {"text": long}


JOBS = {
    "langchain": langchain,
    "llama-openai": llama_openai,
    "llama-tei": llama_tei,
    "haystack": haystack,
    "chroma": chroma,
    "litellm": litellm_job,
    "rerank": ranks,
    "hub": hub,
}

if __name__ == "__main__":
    job, url, path = sys.argv[1:4]
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    texts = Path(path).read_text().splitlines()
    print(json.dumps(JOBS[job](url, texts)))
