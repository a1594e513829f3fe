"""``serving`` command line: up, down, status, render, promote, import...

Every command reads the same stack config file (``--config``, default ``deployments/local.yaml``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
import yaml
from rich.console import Console

from serving.config import ConfigError, StackConfig, load_config
from serving.control.serve_config import build_serve_config
from serving.replica.engine import OFFLINE_ENV

if TYPE_CHECKING:
    from serving.control.stack import LocalDeployer, StackState
    from serving.registry import CheckpointStore

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True)

DEFAULT_CONFIG = Path("deployments/local.yaml")
ConfigOpt = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="Stack config YAML.")

# Environment for the local Ray head and everything it starts (Serve replicas, vLLM engines).
LOCAL_ENV = {**OFFLINE_ENV, "TOKENIZERS_PARALLELISM": "false"}


def _load(path: Path, live: bool = True) -> StackConfig:
    """The stack config; with ``live``, the versions promoted since (the routes file) applied."""
    from serving.control.promotion import apply_routes, routes_path
    from serving.control.stack import RUN_DIR

    try:
        cfg = load_config(path)
        return apply_routes(cfg, routes_path(RUN_DIR, cfg.name)) if live else cfg
    except ConfigError as exc:
        console.print(str(exc), style="red", markup=False, highlight=False)
        raise typer.Exit(2) from None


def _running(cfg: StackConfig, config: Path) -> tuple[StackState, LocalDeployer]:
    from serving.control.stack import LocalDeployer, StackState

    state = StackState.load(cfg.name)
    if state is None:
        console.print(f"no running stack {cfg.name!r}; start it with: serving up -c {config}")
        raise typer.Exit(1)
    return state, LocalDeployer(state, config.resolve().parent, cfg.local_ray.metrics_export_port)


def _store(cfg: StackConfig, config: Path) -> CheckpointStore:
    from serving.registry import CheckpointStore

    root = cfg.checkpoint_root
    if "://" not in root and not Path(root).is_absolute():
        root = str((config.resolve().parent / root).resolve())
    return CheckpointStore(root)


@app.command()
def up(config: Path = ConfigOpt, timeout: float = typer.Option(900, help="Seconds to wait.")) -> None:
    """Build missing models, start a local Ray head and the stack, print the base URL."""
    from serving.control.stack import up as stack_up

    cfg = _load(config)
    try:
        state = stack_up(cfg, config.resolve().parent, LOCAL_ENV, timeout, log=console.print)
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

    cfg = _load(config)
    if not stop_stack(cfg.name, log=console.print):
        console.print(f"no running stack {cfg.name!r}")


@app.command()
def status(config: Path = ConfigOpt) -> None:
    """Show the Serve applications of the running local stack."""
    from serving.control.stack import StackState, serve_status

    cfg = _load(config)
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
    text = yaml.safe_dump(build_serve_config(cfg, config.resolve().parent), sort_keys=False)
    if output:
        output.write_text(text)
    else:
        sys.stdout.write(text)


@app.command()
def promote(
    model: str = typer.Argument(..., help="Model name."),
    version: str = typer.Argument(..., help="Version in the checkpoint store to promote."),
    config: Path = ConfigOpt,
    steps: str = typer.Option("10,50,100", help="Traffic percentages for the new version."),
    step_seconds: float = typer.Option(30, help="How long each step is watched."),
    max_ttft_ratio: float = typer.Option(
        2.0, help="Roll back when the new version's mean TTFT exceeds the live one's times this (plus 50 ms)."
    ),
    api_key_env: str = typer.Option("", help="Env var with an API key for warm-up requests."),
) -> None:
    """Verify, deploy beside the live version, warm up, shift traffic in steps under SLO watch,
    then finish or roll back automatically."""
    import os

    from serving.control.promotion import PromotionError, SloPolicy, routes_path, save_result
    from serving.control.promotion import promote as run_promotion
    from serving.control.stack import RUN_DIR

    cfg = _load(config)
    state, deployer = _running(cfg, config)
    policy = SloPolicy(
        steps=tuple(int(x) for x in steps.split(",")), step_seconds=step_seconds, max_ttft_ratio=max_ttft_ratio
    )
    headers = {"authorization": f"Bearer {os.environ[api_key_env]}"} if api_key_env else {}
    try:
        result = run_promotion(
            cfg,
            model,
            version,
            store=_store(cfg, config),
            deployer=deployer,
            routes_file=routes_path(RUN_DIR, cfg.name),
            base_url=state.base_url,
            policy=policy,
            headers=headers,
            log=console.print,
        )
    except (PromotionError, KeyError) as exc:
        console.print(f"promotion refused: {exc}", style="red", markup=False)
        raise typer.Exit(2) from None
    save_result(RUN_DIR, cfg.name, result)
    print(f"{result.status}: {model}@{version}" + (f" ({result.reason})" if result.reason else ""))
    raise typer.Exit(0 if result.status == "promoted" else 1)


@app.command()
def rollback(
    model: str = typer.Argument(...),
    config: Path = ConfigOpt,
    to: str | None = typer.Option(None, help="Version to keep (default: the one with most traffic)."),
) -> None:
    """Serve one version of a model alone again, removing the others."""
    from serving.control.promotion import PromotionError, routes_path
    from serving.control.promotion import rollback as run_rollback
    from serving.control.stack import RUN_DIR

    cfg = _load(config)
    _, deployer = _running(cfg, config)
    try:
        kept = run_rollback(cfg, model, deployer, routes_path(RUN_DIR, cfg.name), to)
    except (PromotionError, KeyError) as exc:
        console.print(f"rollback refused: {exc}", style="red", markup=False)
        raise typer.Exit(2) from None
    print(f"{model}: serving {kept} alone")


@app.command()
def versions(model: str = typer.Argument(...), config: Path = ConfigOpt) -> None:
    """List a model's versions in the checkpoint store, with their eval scores and traffic."""
    cfg = _load(config)
    store = _store(cfg, config)
    live = {v.version: v.weight for v in cfg.model(model).versions}
    for v in store.list_versions(model):
        man = store.manifest(model, v)
        base = f"{man.base.source}:{man.base.ref}" if man.base else "-"
        scores = " ".join(f"{k}={x:.3f}" for k, x in sorted(man.eval.metrics.items())) if man.eval else "no eval"
        print(f"{v:10} base={base} {scores} traffic={live.get(v, 0)}%")


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
        console.print(f"import failed: {exc}", style="red", markup=False)
        raise typer.Exit(2) from None
    size = sum(manifest.sizes.values())
    print(
        f"imported {model}@{version} ({manifest.architecture or 'unknown architecture'}, "
        f"{len(manifest.files)} files, {size / 1e6:.1f} MB) into {store.uri(model, version)}"
    )


@app.command("render-k8s")
def render_k8s(
    env: str | None = typer.Option(None, "--env", help="Only this overlay (default: all)."),
    check: bool = typer.Option(False, "--check", help="Exit 1 if a generated file is stale."),
) -> None:
    """Render deployments/<env>.yaml into k8s/overlays/<env>/: serve-config.yaml (serveConfigV2) and
    image.yaml (kubernetes.image)."""
    from serving.control.k8s import K8sError, stale_k8s, write_k8s

    try:
        paths = stale_k8s(Path("."), env) if check else write_k8s(Path("."), env)
    except (K8sError, ConfigError) as exc:
        console.print(str(exc), style="red", markup=False)
        raise typer.Exit(2) from None
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

    key = os.environ.get(key_env)
    if not key:
        console.print(f"{key_env} is not set")
        raise typer.Exit(2)
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
