"""FP8 in serving: the flag on the CLI and the services' settings, the pool namespace, the
router refusing a prefill and a decode whose quantization differs, and the backward
compatibility of every serialized form that gained a field (a registration message, a
namespace digest, settings).
"""

from __future__ import annotations

import hashlib
import json

import msgpack
import pytest

from libs.blocks import Namespace
from libs.protocol import decode, encode
from libs.protocol.messages import RegisterInstance
from services.common import parse_settings
from services.router.registry import IncompatibleInstance, Registry
from services.worker.settings import WorkerSettings
from tests.fake_workers import NAMESPACE
from tests.router_harness import MODEL, long_prompt, script_text, start_cluster


def registration(instance_id: str, role: str, quantization: str = "none") -> RegisterInstance:
    return RegisterInstance(
        instance_id=instance_id, role=role, url=f"http://{instance_id}:1", model=MODEL,  # type: ignore[arg-type]
        namespace=NAMESPACE, max_model_len=4096, block_size=16, quantization=quantization,
    )


# -- serialized forms stay compatible ---------------------------------------------------------


def test_namespace_digest_of_unquantized_models_is_unchanged():
    """The digest as computed before ``quantization`` existed (the formula, spelled out):
    every block already in a pool keeps its key."""
    ns = Namespace("abc123", "float32", 16, 1)
    before = "model=abc123|dtype=float32|block_size=16|layout=1|tp=tp1".encode()
    assert ns.digest == hashlib.blake2b(before, digest_size=16, person=b"tidepool.ns").digest()
    assert Namespace("abc123", "float32", 16, 1, "none").digest == ns.digest
    fp8 = Namespace("abc123", "float32", 16, 1, "fp8")
    assert fp8.digest != ns.digest  # fp8 and dense instances never share blocks


def test_unquantized_registration_is_byte_identical_to_the_old_form():
    """An unquantized instance sends exactly the map it sent before the field existed, so a
    router of the previous release accepts it; an old instance's message decodes here."""
    old_form = {
        "type": "RegisterInstance", "version": 1, "instance_id": "d1", "role": "decode", "url": "http://d1:1",
        "model": MODEL, "namespace": NAMESPACE, "max_model_len": 4096, "block_size": 16,
    }
    assert msgpack.unpackb(encode(registration("d1", "decode"))) == old_form
    assert decode(msgpack.packb(old_form), RegisterInstance).quantization == "none"
    fp8 = decode(encode(registration("p1", "prefill", "fp8")), RegisterInstance)
    assert fp8.quantization == "fp8"


def test_worker_settings_take_the_flag_and_default_to_auto(monkeypatch):
    assert parse_settings(WorkerSettings, []).quantization == "auto"
    assert parse_settings(WorkerSettings, ["--quantization", "fp8"]).quantization == "fp8"
    monkeypatch.setenv("TIDEPOOL_QUANTIZATION", "none")
    assert parse_settings(WorkerSettings, []).quantization == "none"
    with pytest.raises(SystemExit):
        parse_settings(WorkerSettings, ["--quantization", "int3"])


# -- the router refuses mixed quantization ------------------------------------------------------


def test_registry_refuses_an_fp8_prefill_with_a_dense_decode_and_vice_versa():
    reg = Registry(heartbeat_timeout_s=5.0)
    reg.register(registration("d1", "decode"))
    with pytest.raises(IncompatibleInstance, match="prefill instance 'p1' runs fp8 weights but decode instance 'd1' runs none"):
        reg.register(registration("p1", "prefill", "fp8"))
    assert "p1" not in reg.instances
    reg.register(registration("p2", "prefill"))  # the same quantization is welcome
    reg2 = Registry(heartbeat_timeout_s=5.0)
    reg2.register(registration("p1", "prefill", "fp8"))
    with pytest.raises(IncompatibleInstance, match="--quantization"):
        reg2.register(registration("d1", "decode"))
    reg2.register(registration("d2", "decode", "fp8"))
    assert sorted(reg2.instances) == ["d2", "p1"]


async def test_router_answers_a_mismatched_registration_400_and_keeps_serving():
    c = await start_cluster(prefills=0, decodes=1)
    try:
        prefill = await c.add_prefill("fp8-prefill", join=False, quantization="fp8")
        status, body = await prefill.register(c.url)
        error = json.loads(body)["error"]
        assert status == 400 and error["code"] == "quantization_mismatch" and error["param"] == "quantization"
        assert "same --quantization" in error["message"]
        async with c.http() as http, http.get("/v1/workers") as resp:
            workers = (await resp.json())["data"]
        assert [(w["id"], w["quantization"]) for w in workers] == [("decode-0", "none")]
        r = await c.openai().completions.create(model=MODEL, prompt=long_prompt(), max_tokens=5)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (script_text(0, 5), "length")
    finally:
        await c.close()
