"""``serving`` command line: up, down, status, render, promote, import...

Every command reads the same stack config file (``--config``, default ``deployments/local.yaml``).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer
import yaml
from rich.console import Console

from serving.config import ConfigError, ModelConfig, StackConfig, load_config
from serving.control.serve_config import build_serve_config
from serving.manifest import manifest_sha256
from serving.redact import redact_uri
from serving.replica.engine import OFFLINE_ENV

if TYPE_CHECKING:
    from serving.record import ControlStore
    from serving.registry import CheckpointStore

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True)

DEFAULT_CONFIG = Path("deployments/local.yaml")
ConfigOpt = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="Stack config YAML.")

# Environment for the local Ray head and everything it starts (Serve replicas, vLLM engines).
LOCAL_ENV = {**OFFLINE_ENV, "TOKENIZERS_PARALLELISM": "false"}


def _load(path: Path, live: bool = True) -> StackConfig:
    """The stack config; with ``live``, the live versions recorded in the store applied. A config
    or store that cannot be read: its message, exit 2."""
    from serving.control.requests import live_config

    try:
        cfg = load_config(path)
    except ConfigError as exc:
        _fail(str(exc))
    if not live:
        return cfg
    try:
        control = _control(cfg, path)
        _migrate_routes(cfg, control)
        return live_config(cfg, control)
    except (OSError, ValueError, ImportError) as exc:  # a corrupt live.json: a json or pydantic ValueError
        root = redact_uri(cfg.store_root(path.resolve().parent))
        _fail(f"{path}: cannot read the promotion record in the checkpoint store {root}: {type(exc).__name__}: {exc}")


def _fail(message: str) -> NoReturn:
    console.print(redact_uri(message), style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _model(cfg: StackConfig, name: str, path: Path) -> ModelConfig:
    """The config's model NAME, or exit 2 saying it is not there (add it and `serving up` first)."""
    try:
        return cfg.model(name)
    except KeyError:
        names = ", ".join(m.name for m in cfg.models)
        _fail(f"model {name!r} is not in {path} (its models: {names})")


def _migrate_routes(cfg: StackConfig, control: ControlStore) -> None:
    """Once: the routes file earlier versions kept in .run/ becomes the store's record."""
    from serving.control.stack import RUN_DIR

    routes = RUN_DIR / f"{cfg.name}.versions.json"
    if not routes.is_file() or control.live():
        return
    for model, versions in json.loads(routes.read_text()).items():
        control.set_live(model, [(v["version"], int(v["weight"])) for v in versions])
    routes.rename(routes.with_suffix(".json.migrated"))
    console.print(f"moved the live versions of {routes} into {control.base}/live.json")


def _control(cfg: StackConfig, config: Path) -> ControlStore:
    from serving.record import ControlStore

    return ControlStore(_store(cfg, config).root, cfg.name)


def _store(cfg: StackConfig, config: Path) -> CheckpointStore:
    from serving.registry import CheckpointStore

    root = cfg.checkpoint_root
    if "://" not in root and not Path(root).is_absolute():
        root = str((config.resolve().parent / root).resolve())
    return CheckpointStore(root)


@app.command()
def up(
    config: Path = ConfigOpt,
    timeout: float = typer.Option(900, help="Seconds to wait."),
    early: bool = typer.Option(True, help="Deploy each model once it is built, while the others still train."),
) -> None:
    """Build missing models, start a local Ray head and the stack, print the base URL."""
    from serving.control.stack import up as stack_up

    seed = _load(config, live=False)
    cfg = _load(config)  # the live versions of the store's record: a re-run keeps promotions
    try:
        # one line per message, never wrapped: a status line of four applications passes 80 columns
        log = functools.partial(console.print, soft_wrap=True, markup=False, highlight=False)
        state = stack_up(cfg, config.resolve().parent, LOCAL_ENV, timeout, log=log, seed=seed, early=early)
    except (RuntimeError, TimeoutError, FileNotFoundError, ConfigError) as exc:
        console.print(f"serving up failed: {exc}", style="red", markup=False)
        console.print(f"Stop what started with: serving down -c {config}", markup=False)
        raise typer.Exit(1) from None
    model = cfg.models[0].name
    console.print(f"[green]stack {cfg.name!r} is up[/green]")
    print(f"{state.base_url}/v1")
    console.print("try:")
    # print, not the console: rich wraps at the terminal width and a wrapped command does not paste
    print(
        f"  curl -N {state.base_url}/v1/chat/completions -H 'content-type: application/json' "
        f"""-d '{{"model": "{model}", "messages": [{{"role": "user", "content": "37+45="}}], """
        f""""max_tokens": 8, "stream": true}}'""",
        file=sys.stderr,
        flush=True,
    )


@app.command()
def down(config: Path = ConfigOpt) -> None:
    """Stop the stack and the local Ray head that ``up`` started."""
    from serving.control.stack import stop_stack

    cfg = _load(config, live=False)  # the stack's name only: no store needed
    if not stop_stack(cfg.name, log=console.print):
        console.print(f"no running stack {cfg.name!r}")


@app.command()
def status(config: Path = ConfigOpt) -> None:
    """Show the Serve applications of the running local stack."""
    from serving.control.stack import StackState, serve_status

    cfg = _load(config, live=False)
    state = StackState.load(cfg.name)
    if state is None:
        console.print(f"no running stack {cfg.name!r}")
        raise typer.Exit(1)
    apps = serve_status(state).get("applications", {})
    for name, a in sorted(apps.items()):
        deps = {d: (v.get("status"), len(v.get("replicas", []))) for d, v in a.get("deployments", {}).items()}
        print(f"{name:32} {a.get('status'):14} {deps}")


@app.command()
def render(config: Path = ConfigOpt, output: Path | None = typer.Option(None, "-o")) -> None:
    """Print the Serve config (the ``serve deploy`` schema) this stack config produces."""
    cfg = _load(config)
    seed = _load(config, live=False)
    text = yaml.safe_dump(build_serve_config(cfg, config.resolve().parent, seed=seed), sort_keys=False)
    if output:
        try:
            output.write_text(text)
        except OSError as exc:
            _fail(f"cannot write {output}: {exc.strerror or exc}")
    else:
        sys.stdout.write(text)


@app.command()
def promote(
    model: str = typer.Argument(..., help="Model name."),
    version: str | None = typer.Argument(None, help="Version in the checkpoint store to promote."),
    config: Path = ConfigOpt,
    abort: bool = typer.Option(False, "--abort", help="Roll back the model's promotion in progress."),
    steps: str | None = typer.Option(None, help="Traffic percentages (default: models[].promotion.steps)."),
    step_seconds: float | None = typer.Option(None, help="How long each step is watched."),
    max_ttft_ratio: float | None = typer.Option(None, help="TTFT percentile limit, times the live version's."),
    follow: bool = typer.Option(True, help="Follow the promotion until it ends."),
    timeout: float = typer.Option(1800, help="Seconds to follow."),
) -> None:
    """Ask the promotion controller to canary MODEL@VERSION (or --abort the one in progress), then
    follow its steps. Exit 0 promoted, 1 rolled back or aborted, 2 refused, 3 nobody took it."""
    from serving.control.controller import policy_for
    from serving.control.requests import submit

    cfg = _load(config, live=False)
    m = _model(cfg, model, config)
    if not abort and version is None:
        _fail("give a VERSION to promote, or --abort")
    overrides: dict[str, object] = {}
    try:
        if steps:
            overrides["steps"] = [int(x) for x in steps.split(",")]
        if step_seconds is not None:
            overrides["step_seconds"] = step_seconds
        if max_ttft_ratio is not None:
            overrides["max_ttft_ratio"] = max_ttft_ratio
        policy_for(m, overrides)  # the controller refuses what does not validate: say it now
    except ValueError as exc:
        hint = " (--steps: percentages rising to 100, e.g. 10,50,100)" if steps else ""
        console.print(f"{exc}{hint}", style="red", markup=False)
        raise typer.Exit(2) from None
    control = _control(cfg, config)
    at, _ = submit(control, model, "abort" if abort else "promote", None if abort else version, overrides)
    _follow(control, model, at, None if abort else version, follow, timeout)


def _follow(control: ControlStore, model: str, at: float, version: str | None, follow: bool, timeout: float) -> None:
    from serving.control.requests import controller_alive
    from serving.control.requests import follow as follow_record

    if not controller_alive(control):
        console.print("no promotion controller holds the store lock: the request waits until one runs")
    if not follow:
        print(f"submitted to the promotion controller ({control.base})")
        return
    rec = follow_record(control, model, at, version, print, timeout)
    if rec is None:
        print(f"no promotion controller took the request within {timeout:.0f}s")
        raise typer.Exit(3)
    print(f"{rec.status}: {rec.model}@{rec.version}" + (f" ({rec.reason})" if rec.reason else ""))
    raise typer.Exit({"promoted": 0, "refused": 2}.get(rec.status, 1))


@app.command()
def rollback(
    model: str = typer.Argument(...),
    config: Path = ConfigOpt,
    to: str | None = typer.Option(None, help="Version to keep (default: the one with most traffic)."),
) -> None:
    """Roll back the model's promotion in progress, or serve one deployed version alone again."""
    from serving.control.requests import submit

    cfg = _load(config, live=False)
    deployed = [v.version for v in _model(_load(config), model, config).versions]
    if to is not None and to not in deployed:  # the controller refuses it too
        _fail(f"{model}@{to} is not deployed ({model} serves {', '.join(deployed)})")
    control = _control(cfg, config)
    at, key = submit(control, model, "rollback", to, {})
    _follow(control, model, at, None, True, 120) if control.active(model) else _wait_taken(control, model, key)
    print(f"{model}: {', '.join(f'{v.version}={v.weight}%' for v in _model(_load(config), model, config).versions)}")


def _wait_taken(control: ControlStore, model: str, key: str, timeout_s: float = 120) -> None:
    from serving.waiting import poll

    if not poll(lambda: control.pending_request(model, key) is None, timeout_s, 1):
        console.print("no promotion controller took the request", style="red")
        raise typer.Exit(3)


@app.command()
def promotions(model: str | None = typer.Argument(None), config: Path = ConfigOpt, last: int = 10) -> None:
    """History of promotions: what, when, each step's figures, why it finished or rolled back."""
    from serving.control.requests import controller_alive, format_record

    cfg = _load(config, live=False)
    control = _control(cfg, config)
    state = "active" if controller_alive(control) else "none holds the lock"
    print(f"promotion controller: {state}; record in {control.base}")
    for name in [model] if model else control.models_with_history():
        for rec in control.history(name)[-last:]:
            print(format_record(rec))


@app.command()
def versions(model: str = typer.Argument(...), config: Path = ConfigOpt) -> None:
    """List a model's versions in the checkpoint store, with their eval scores, traffic and the
    sha256 of their manifest (a version's ``manifest_sha256`` pin in the stack config)."""
    cfg = _load(config)
    store = _store(cfg, config)
    live = {v.version: v.weight for v in _model(cfg, model, config).versions}
    for v in store.list_versions(model):
        man, raw = store.read_manifest(model, v)
        base = f"{man.base.source}:{man.base.ref}" if man.base else "-"
        scores = " ".join(f"{k}={x:.3f}" for k, x in sorted(man.eval.metrics.items())) if man.eval else "no eval"
        print(f"{v:10} base={base} {scores} traffic={live.get(v, 0)}% manifest_sha256={manifest_sha256(raw)}")


@app.command("import")
def import_(
    source: str = typer.Argument(..., help="A Hugging Face folder, an fsspec URI of one, or a hub id (org/name)."),
    model: str = typer.Option(..., "--model", help="Model name in the store."),
    version: str = typer.Option(..., "--version", help="New version name (an existing one is refused)."),
    config: Path = ConfigOpt,
    root: str | None = typer.Option(None, "--root", help="Store root (default: the config's checkpoint_root)."),
) -> None:
    """Bring an external model into the checkpoint store: every file hashed into a manifest, with
    its architecture and where it came from (``base``); no eval, so an eval gate refuses it."""
    from serving.control.importer import ImportFailed, import_model
    from serving.registry import CheckpointStore, RegistryError

    store = CheckpointStore(root) if root else _store(_load(config, live=False), config)
    try:
        manifest = import_model(source, store, model, version, log=console.print)
    except (ImportFailed, RegistryError, ValueError, OSError) as exc:
        _fail(f"import failed: {exc}")
    size = sum(manifest.sizes.values())
    print(
        f"imported {model}@{version} ({manifest.architecture or 'unknown architecture'}, "
        f"{len(manifest.files)} files, {size / 1e6:.1f} MB) into {store.uri(model, version)}"
    )
    print(f"manifest_sha256: {manifest_sha256(store.read_manifest(model, version)[1])}")


@app.command("render-k8s")
def render_k8s(
    env: str | None = typer.Option(None, "--env", help="Only this overlay (default: all)."),
    check: bool = typer.Option(False, "--check", help="Exit 1 if a generated file is stale."),
    written: bool = typer.Option(
        False, "--as-written", help="The versions of the YAML, without the promotion record's live versions."
    ),
) -> None:
    """Render deployments/<env>.yaml into k8s/overlays/<env>/: serve-config.yaml (serveConfigV2) and
    image.yaml (kubernetes.image). The live versions and weights recorded in the checkpoint store
    are applied over the YAML's, as ``serving up`` applies them; where the store is not reachable,
    those the committed file names are kept."""
    from serving.control.k8s import K8sError, as_written, stale_k8s, store_live, write_k8s

    live = as_written if written else store_live
    try:
        paths = stale_k8s(Path("."), env, live) if check else write_k8s(Path("."), env, live)
    except (K8sError, ConfigError) as exc:
        _fail(str(exc))
    for p in paths:
        print(p)
    if check and paths:
        raise typer.Exit(1)


keys_app = typer.Typer(help="API keys for tenants.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@keys_app.command("new")
def keys_new(tenant: str = typer.Option(..., "--tenant", help="Tenant the key is for (for the hint).")) -> None:
    """Print a new random API key (give it to the client) and its salted hash (put it in the config)."""
    from serving.gateway.admission.auth import hash_key, new_key

    key = new_key()
    print(f"api key (give to the client, shown once): {key}")
    print(f'config line for tenant {tenant!r}:  key_hashes: ["{hash_key(key)}"]')


@keys_app.command("hash")
def keys_hash(key_env: str = typer.Option(..., "--from-env", help="Env var holding an existing key.")) -> None:
    """Hash an existing key read from an environment variable (never from the command line)."""
    import os

    from serving.gateway.admission.auth import hash_key

    key = (os.environ.get(key_env) or "").strip()  # as the gateway reads a key_env (a Secret file's newline)
    if not key:
        _fail(f"{key_env} is not set or empty")
    print(hash_key(key))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def loadtest(ctx: typer.Context) -> None:
    """Run a Locust scenario headless (same options as ``python -m loadtests.run``)."""
    from loadtests.run import main as run_main

    run_main(list(ctx.args))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context) -> None:
    """Benchmark bare vLLM, stock Ray Serve LLM and this stack (``python -m loadtests.bench``)."""
    from loadtests.bench import main as bench_main

    bench_main(list(ctx.args))


@app.command("config-reference")
def config_reference() -> None:
    """Print the Markdown reference of every stack-config field (docs/configuration.md)."""
    from serving.control.reference import config_reference as ref

    sys.stdout.write(ref())


@app.command("validate")
def validate(config: Path = ConfigOpt) -> None:
    """Validate a stack config file and print it normalised."""
    cfg = _load(config)
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
