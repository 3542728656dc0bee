"""Object storage: s3:// against a real S3-compatible server (moto) on 127.0.0.1, and memory://.

The commit protocol on object stores has no rename: arrays first, ``manifest.json`` last; a
prefix without a manifest is not a checkpoint; an overwrite writes the new arrays under a fresh
generation prefix and deletes the old ones only after the new manifest is written. The
scenarios S3 shares with GCS run on both from tests/test_object_stores.py; here, S3's own.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable

import boto3  # noqa: E402  (test extra)
import jax.numpy as jnp
import moto.server as moto_server  # noqa: E402
import numpy as np
import pytest
from helpers import assert_tree_equal, mesh, one_array_per_leaf, put  # noqa: F401 (autouse)
from http_proxy import Proxy

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._runtime.pools import settle
from jaxckpt._storage import catalog as _catalog
from jaxckpt._storage import location as _location

BUCKET = "ckpts"


@pytest.fixture(scope="session")
def s3():
    """A moto S3 server on a free port of 127.0.0.1, with the AWS variables pointing at it."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    yield client
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def prefix(s3) -> str:
    """A fresh prefix in the bucket for one test."""
    return f"t-{uuid.uuid4().hex[:8]}"


def hold_commit(monkeypatch, lost: str) -> tuple[Proxy, Callable[[], None]]:
    """Fault hook: from now on S3 is reached through a proxy that holds each PUT of a
    manifest.json, its request (``lost="request"``) or its answer (``"answer"``). Returns the
    proxy (stop it after the test) and what heals the link."""
    stall = {"on": True}

    def rule(method, path):
        if stall["on"] and method == "PUT" and "manifest.json" in path:
            return "hold" if lost == "request" else "forward-then-hold"
        return "pass"

    proxy = Proxy(os.environ["AWS_ENDPOINT_URL"], rule)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    return proxy, lambda: stall.update(on=False)


def keys(s3, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1 :] for p in pages for o in p.get("Contents", []))


def state(scale: float = 1.0) -> dict:
    m = mesh((4, 2), ("data", "model"))
    return {
        "w": put(jnp.arange(64.0).reshape(8, 8) * scale, m, "data", "model"),
        "b": put(jnp.ones(8, jnp.bfloat16) * scale, m, None),
        "step": int(scale),
    }


class FailingPlanner(jaxckpt.DefaultSavePlanner):
    """Fails while writing ``fail_key``, after other arrays may already be written."""

    def __init__(self, fail_key: str) -> None:
        super().__init__()
        self.fail_key = fail_key

    def resolve_data(self, item):
        if item.key == self.fail_key:
            raise RuntimeError(f"injected failure writing {item.key}")
        return super().resolve_data(item)


def jax_to_numpy(tree: dict) -> dict:
    return {k: np.asarray(v) if hasattr(v, "shape") else v for k, v in tree.items()}


def test_failed_save_leaves_no_checkpoint_and_a_retry_works(s3, prefix):
    url = f"s3://{BUCKET}/{prefix}"
    with pytest.raises(RuntimeError, match="injected failure writing w"):
        jaxckpt.save(url, state(), planner=FailingPlanner("w"))
    assert keys(s3, prefix) == []  # no commit, and the failed save removed its own data
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=f"No checkpoint at {url}"):
        jaxckpt.restore(url)
    assert not _location.exists(_location.Location(url))
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/arrays/w/zarr.json", Body=b"{}")  # a crash's
    jaxckpt.save(url, state())  # leftovers do not block a plain retry, and go at its commit
    settle()  # (in the background, after it)
    assert "arrays/w/zarr.json" not in keys(s3, prefix)
    assert jaxckpt.restore(url)["step"] == 1


def test_foreign_objects_are_not_replaced_without_overwrite(s3, prefix):
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/notes.txt", Body=b"mine")
    url = f"s3://{BUCKET}/{prefix}"
    with pytest.raises(jaxckpt.CheckpointExistsError, match="holds no checkpoint.*'notes.txt'"):
        jaxckpt.save(url, state())
    assert keys(s3, prefix) == ["notes.txt"]
    with pytest.raises(jaxckpt.CheckpointExistsError, match="even with overwrite=True"):
        jaxckpt.save(url, state(), overwrite=True)  # overwrite never deletes foreign objects
    assert keys(s3, prefix) == ["notes.txt"]


def test_overwrite_commits_then_deletes_the_old_arrays(s3, prefix):
    url = f"s3://{BUCKET}/{prefix}"
    jaxckpt.save(url, state())
    jaxckpt.save(url, {"w2": jnp.full(5, 3.0)}, overwrite=True)
    settle()  # the replaced generation goes in the background
    after = keys(s3, prefix)
    gens = {k.split("/")[0] for k in after if k != "manifest.json"}
    assert len(gens) == 1 and all(g.startswith("g") for g in gens), after
    (gen,) = gens
    assert not any(k.startswith("arrays/") for k in after)  # the old arrays are gone
    assert jaxckpt.metadata(url).entries["w2"].path == f"{gen}/arrays/w2"
    np.testing.assert_array_equal(jaxckpt.restore(url)["w2"], np.full(5, 3.0))
    jaxckpt.save(url, state(4.0), overwrite=True)  # and again: a new generation replaces it
    settle()
    assert not any(k.startswith(gen) for k in keys(s3, prefix))
    assert_tree_equal(jaxckpt.restore(url), jax_to_numpy(state(4.0)))


def test_failed_overwrite_keeps_the_old_checkpoint(s3, prefix):
    url = f"s3://{BUCKET}/{prefix}"
    jaxckpt.save(url, state())
    settle()  # its lease (writer.json) goes after the commit, in the background
    before = keys(s3, prefix)
    manifest = s3.get_object(Bucket=BUCKET, Key=f"{prefix}/manifest.json")["Body"].read()
    with pytest.raises(RuntimeError, match="injected failure"):
        jaxckpt.save(url, state(2.0), overwrite=True, planner=FailingPlanner("w"))
    assert set(keys(s3, prefix)) == set(before)  # the failed save removed its own data only
    assert s3.get_object(Bucket=BUCKET, Key=f"{prefix}/manifest.json")["Body"].read() == manifest
    assert_tree_equal(jaxckpt.restore(url), jax_to_numpy(state()))
    assert main(["verify", url]) == 0
    jaxckpt.save(url, state(3.0), overwrite=True)  # the retry writes and keeps one generation
    settle()
    assert_tree_equal(jaxckpt.restore(url), jax_to_numpy(state(3.0)))
    assert len({k.split("/")[0] for k in keys(s3, prefix)}) == 2  # manifest.json + one gen


def test_missing_bucket_and_bad_urls(s3):
    with pytest.raises(
        jaxckpt.CheckpointError,
        # tensorstore 0.1.81 reports the missing bucket as "Malformed List response".
        match="Cannot list s3://no-such-bucket/x: .*(NoSuchBucket|Malformed List).*bucket exists",
    ):
        jaxckpt.save("s3://no-such-bucket/x", state())
    with pytest.raises(
        jaxckpt.CheckpointNotFoundError, match="No checkpoint at s3://no-such-bucket/x"
    ):
        jaxckpt.restore("s3://no-such-bucket/x")
    with pytest.raises(
        jaxckpt.CheckpointError, match="names no valid bucket .*write s3://BUCKET/PREFIX"
    ):
        jaxckpt.save("s3:///x", state())


def test_s3_options_come_from_the_aws_variables(monkeypatch):
    for k in (
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "TENSORSTORE_S3_USE_CONDITIONAL_WRITE",
    ):
        monkeypatch.delenv(k, raising=False)
    spec = _location.Location("s3://bkt/p/q/").kvstore
    retries = spec.pop("context")  # bounded, and throttling outlasted (urls.retries)
    assert spec == {"driver": "s3", "bucket": "bkt", "path": "p/q/"}
    assert retries["s3_request_retries"]["max_retries"] == 12
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:10")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    spec = _location.Location("s3://bkt").kvstore
    spec.pop("context")
    assert spec == {
        "driver": "s3",
        "bucket": "bkt",
        "path": "",
        "endpoint": "http://127.0.0.1:10",
        "aws_region": "eu-west-1",
        "aws_credentials": {"type": "environment"},
    }


@pytest.mark.parametrize("conditional", ["1", None])
def test_conditional_writes_are_one_put_where_the_server_honours_them(
    s3, prefix, monkeypatch, conditional
):
    """With TENSORSTORE_S3_USE_CONDITIONAL_WRITE=1 (moto honours If-None-Match and If-Match)
    the lease and the commit go without a HEAD first, and a second save is still refused."""
    monkeypatch.delenv("TENSORSTORE_S3_USE_CONDITIONAL_WRITE", raising=False)
    if conditional:
        monkeypatch.setenv("TENSORSTORE_S3_USE_CONDITIONAL_WRITE", conditional)
    proxy = Proxy(os.environ["AWS_ENDPOINT_URL"], lambda method, path: "pass")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        url = f"s3://{BUCKET}/{prefix}"
        jaxckpt.save(url, state())
        heads = [p for m, p, _ in proxy.seen if m == "HEAD" and "writer.json" in p]
        assert bool(heads) == (conditional is None), proxy.seen
        with pytest.raises(jaxckpt.CheckpointExistsError, match="already exists"):
            jaxckpt.save(url, state(2.0))
        assert jaxckpt.restore(url)["step"] == 1
    finally:
        proxy.stop()


# memory:// -- the same protocol, no server ------------------------------------------------


def test_memory_roundtrip_overwrite_list_delete():
    run = f"memory://{uuid.uuid4().hex[:8]}"
    jaxckpt.save(f"{run}/000001", state())
    assert_tree_equal(jaxckpt.restore(f"{run}/000001"), jax_to_numpy(state()))
    with pytest.raises(RuntimeError):
        jaxckpt.save(f"{run}/000002", state(), planner=FailingPlanner("w"))
    assert _catalog.children(_location.Location(run)) == [("000001", True)]  # removed its data
    kv = _location.kvstore(_location.Location(run).kvstore)
    kv.write("000002/arrays/w/zarr.json", b"{}").result()  # what a crash leaves
    assert _catalog.children(_location.Location(run)) == [("000001", True), ("000002", False)]
    _catalog.delete(_location.Location(f"{run}/000002"))
    assert _catalog.children(_location.Location(run)) == [("000001", True)]
    jaxckpt.save(f"{run}/000001", state(5.0), overwrite=True)
    assert_tree_equal(jaxckpt.restore(f"{run}/000001"), jax_to_numpy(state(5.0)))
