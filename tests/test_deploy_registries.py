"""One image, every region: `trainbox launch image --push --registry R1 --registry R2` (or `--registries FILE`,
region -> registry) builds once and pushes one digest everywhere, and `launch k8s/sky --region R --registries FILE`
pull from the region's registry. The rendered commands are checked (one build; every push copies the same
archive with --preserve-digests), then the copies are run for real: skopeo, as rendered, pushing a small OCI
archive (made here: no Docker engine to build one) to two local registries (the distribution registry, Debian's
docker-registry, over TLS with a certificate made here), which must then serve one digest under every name. Bad
input ends in one message, exit 2."""
from __future__ import annotations

import datetime
import gzip
import hashlib
import io
import ipaddress
import json
import os
import socket
import subprocess
import tarfile
import time

import pytest
import yaml
from conftest import REPO, run_cli
from nodes import free_port
from test_deploy_files import DOCKERFILES, tool

from trainbox.errors import ConfigError
from trainbox.launch.image import build_commands, dockerfile_args, image_tag
from trainbox.launch.registry import check_registry

ARGS = dockerfile_args(DOCKERFILES[0])
STACK = image_tag(ARGS["TRAINBOX_VERSION"], ARGS, rocm=False)


def _pushes(commands: list[list[str]]) -> tuple[list[str], str, list[tuple[str, str]]]:
    """-> (the one build command, its OCI archive, [(source, destination)] of every push)."""
    builds = [c for c in commands if c[:3] == ["docker", "buildx", "build"]]
    assert len(builds) == 1, commands
    [build] = builds
    output = build[build.index("--output") + 1]
    assert output.startswith("type=oci,dest=") and "--push" not in build and "--tag" not in build, build
    copies = [c for c in commands if c[0] == "skopeo"]
    assert all(c[:5] == ["skopeo", "copy", "--all", "--preserve-digests", c[4]] and len(c) == 6 for c in copies)
    assert commands.index(build) < min(commands.index(c) for c in copies)   # built before anything is pushed
    return build, output.split("dest=", 1)[1], [(c[4], c[5]) for c in copies]


def test_several_registries_get_one_build_copied_with_its_digest():
    regs = ["123456789012.dkr.ecr.us-east-1.amazonaws.com/ml", "europe-west4-docker.pkg.dev/proj/ml"]
    commands = build_commands(REPO, regs, "v7", push=True)
    _, archive, pushes = _pushes(commands)
    # the digest-preserving property as rendered: every push has the same source, the one build's archive
    assert {src for src, _ in pushes} == {f"oci-archive:{archive}"}
    assert [dst for _, dst in pushes] == [f"docker://{r}/{t}" for r in regs for t in (STACK, "trainbox:v7")]
    # one registry keeps the plain buildx push; no push builds into the local store with every name
    [one] = build_commands(REPO, regs[:1], "v7", push=True)
    assert "--push" in one and one.count("--tag") == 2
    [local] = build_commands(REPO, regs, None, push=False)
    assert "--load" in local and [local[i + 1] for i, a in enumerate(local) if a == "--tag"] == [
        f"{r}/{STACK}" for r in regs]


def test_launch_image_prints_the_pushes_of_a_registries_file(tmp_path):
    regions = tmp_path / "regions.yaml"
    regions.write_text("us-east-1: 123456789012.dkr.ecr.us-east-1.amazonaws.com/ml\n"
                       "europe-west4: europe-west4-docker.pkg.dev/proj/ml/\n")
    proc = run_cli("launch", "image", "--push", "--registries", str(regions), "--registry", "ghcr.io/org",
                   "--registry", "europe-west4-docker.pkg.dev/proj/ml", "--tag", "v7", "--dry-run", "--context",
                   str(REPO))
    commands = [line.split() for line in proc.stdout.splitlines()]
    _, archive, pushes = _pushes(commands)
    dests = [dst for _, dst in pushes]
    assert len(dests) == len(set(dests)) == 6        # three registries (one named twice), two tags each
    assert {d.rsplit("/trainbox:", 1)[0] for d in dests} == {
        "docker://ghcr.io/org", "docker://europe-west4-docker.pkg.dev/proj/ml",
        "docker://123456789012.dkr.ecr.us-east-1.amazonaws.com/ml"}
    assert not (REPO / archive).exists()             # --dry-run ran nothing


@pytest.mark.parametrize("name", ["https://ghcr.io/org", "ghcr.io/Org", "ghcr.io/org:latest", "ghcr .io/org", ""])
def test_malformed_registry_names_are_refused(name):
    with pytest.raises(ConfigError, match="is not a registry name"):
        check_registry(name)


@pytest.mark.parametrize("content, flags, message", [
    ("", [], "names no registries"),
    ("{}", [], "names no registries"),
    ("- ghcr.io/org\n", [], "expected a mapping of region -> registry name"),
    ("us: https://ghcr.io/org\n", [], "region us: 'https://ghcr.io/org' is not a registry name (drop the scheme)"),
    (None, ["--registry", "ghcr.io/org:v1"], "'ghcr.io/org:v1' is not a registry name (drop the tag"),
    (None, [], "--push needs --registry"),
])
def test_launch_image_refuses_bad_registries(tmp_path, content, flags, message):
    if content is not None:
        (tmp_path / "r.yaml").write_text(content)
        flags = [*flags, "--registries", str(tmp_path / "r.yaml")]
    proc = run_cli("launch", "image", "--push", "--dry-run", "--context", str(REPO), *flags, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_k8s_and_sky_pull_from_the_regions_registry(tmp_path):
    regions = tmp_path / "regions.json"
    regions.write_text(json.dumps({"us-east-1": "111.dkr.ecr.us-east-1.amazonaws.com/ml",
                                   "europe-west4": "europe-west4-docker.pkg.dev/proj/ml"}))
    common = ["tiny", "--image", "trainbox:v7", "--registries", str(regions), "--region", "europe-west4"]
    want = "europe-west4-docker.pkg.dev/proj/ml/trainbox:v7"
    run_cli("launch", "k8s", *common, "--out", str(tmp_path / "pj"))
    job = yaml.safe_load((tmp_path / "pj" / "pytorchjob.yaml").read_text())
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"] == want
    run_cli("launch", "k8s", *common, "--api", "trainer", "--out", str(tmp_path / "tj"))
    runtime = yaml.safe_load((tmp_path / "tj" / "runtime.yaml").read_text())
    [node] = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["template"]["spec"]["template"]["spec"]["containers"][0]["image"] == want
    run_cli("launch", "sky", *common, "--gpus", "H100:8", "--out", str(tmp_path / "sky"))
    task = yaml.safe_load((tmp_path / "sky" / "task.yaml").read_text())
    assert task["resources"]["image_id"] == f"docker:{want}" and task["resources"]["region"] == "europe-west4"


@pytest.mark.parametrize("flags, message", [
    (["--region", "ap-south-1"], "--region ap-south-1: REGIONS names no registry for it"),
    ([], "needs --region (the cluster's region) to pick one of us-east-1"),
    (["--region", "us-east-1", "--image", "ghcr.io/org/trainbox:v7"], "with --registries give the image's name"),
])
def test_region_choice_refuses_bad_input(tmp_path, flags, message):
    regions = tmp_path / "regions.yaml"
    regions.write_text("us-east-1: 111.dkr.ecr.us-east-1.amazonaws.com/ml\n")
    image = [] if "--image" in flags else ["--image", "trainbox:v7"]
    proc = run_cli("launch", "k8s", "tiny", *image, "--registries", str(regions), *flags, "--out",
                   str(tmp_path / "x"), check=False)
    message = message.replace("REGIONS", str(regions))
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = run_cli("launch", "k8s", "tiny", "--image", "i:1", "--region", "us-east-1", "--out", str(tmp_path / "x"),
                   check=False)
    assert proc.returncode == 2 and "picks a registry from --registries FILE" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- the pushes, run


def _blob(root, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def oci_archive(path) -> str:
    """A one-layer OCI image archive, the shape buildx's `--output type=oci` writes; returns its manifest digest."""
    root = path.parent / "layout"
    (root / "blobs" / "sha256").mkdir(parents=True)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size = 6
        tar.addfile(info, io.BytesIO(b"hello\n"))
    layer = _blob(root, gzip.compress(raw.getvalue(), mtime=0))
    config = _blob(root, json.dumps({"architecture": "amd64", "os": "linux", "config": {}, "rootfs": {
        "type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(raw.getvalue()).hexdigest()}"]}}).encode())
    manifest = _blob(root, json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer}]}).encode())
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest}]}))
    with tarfile.open(path, "w") as tar:
        for item in sorted(root.iterdir()):
            tar.add(item, arcname=item.name)
    return manifest["digest"]


def certificate(tmp_path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 -> (certificate file, key file)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


def _registry(tmp_path, name: str, cert: tuple[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    conf = tmp_path / f"{name}.yml"
    conf.write_text(yaml.safe_dump({"version": 0.1, "log": {"level": "warn"},
                                    "storage": {"filesystem": {"rootdirectory": str(tmp_path / name)}},
                                    "http": {"addr": f"127.0.0.1:{port}",
                                             "tls": {"certificate": cert[0], "key": cert[1]}}}))
    proc = subprocess.Popen([tool("docker-registry"), "serve", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / f"{name}.log", "w"))
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()
            time.sleep(0.05)   # polling a server that is not up yet


def test_the_rendered_pushes_give_every_registry_one_digest(tmp_path):
    """The skopeo commands exactly as rendered, run from the build's folder against two local registries (their
    certificate trusted through SSL_CERT_FILE: a setting of the host, not of the command)."""
    skopeo = tool("skopeo")
    cert = certificate(tmp_path)
    procs = []
    try:
        for name in ("east", "west"):
            procs.append(_registry(tmp_path, name, cert))
        regs = [f"{host}/ml" for _, host in procs]
        commands = build_commands(REPO, regs, "v7", push=True)
        _, archive, pushes = _pushes(commands)
        work = tmp_path / "context"
        (work / "build").mkdir(parents=True)
        digest = oci_archive(work / archive)      # what the build step writes
        env = {**os.environ, "SSL_CERT_FILE": cert[0]}
        for cmd in (c for c in commands if c[0] == "skopeo"):
            subprocess.run([skopeo, *cmd[1:]], cwd=work, env=env, check=True, capture_output=True, timeout=60)
        got = {dst: subprocess.run([skopeo, "inspect", "--format", "{{.Digest}}", dst], env=env, check=True,
                                   capture_output=True, text=True, timeout=60).stdout.strip() for _, dst in pushes}
        assert len(got) == 4 and set(got.values()) == {digest}, got
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(timeout=30)
