"""`vllm-aot cache status | lookup | cleanup | sync`: the compile cache from the command line."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def _cache(args: argparse.Namespace):
    from vllm_aot.cache.program_cache import CacheSettings, ProgramCache

    try:
        return ProgramCache(CacheSettings.from_env(root=args.cache_dir, remote_url=args.remote))
    except ValueError as exc:  # a bad URL, signing key or contradicting settings
        raise SystemExit(f"error: {exc}") from exc


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    from vllm_aot.cache.admin import current_version, status

    s = status(_cache(args))
    console.print(
        f"local cache {s.root}: {s.num_entries} programs, {s.total_bytes / 1e6:.1f} MB, "
        f"{s.configurations} configurations"
    )
    console.print(f"this installation: {current_version()}")
    for version, count in sorted(s.versions.items()):
        console.print(f"  {count:4d} programs built by {version}")
    if s.remote_url:
        found = (
            f"unreachable ({s.remote_failure})"
            if s.remote_failure
            else f"{s.remote_entries} programs"
        )
        trust = (
            "signed (uploads signed, unsigned objects refused)"
            if s.is_signing
            else "unsigned: its objects are trusted as-is (set VLLM_AOT_CACHE_SIGNING_KEY)"
        )
        mode = ", read-only" if s.is_read_only else ""
        console.print(f"remote store {s.remote_url}: {found}; {trust}{mode}")
    for failure in s.failed:
        error = failure["error"].strip().splitlines()[-1:] or ["?"]
        console.print(f"failed: {failure['name']} ({failure['key']}): {error[0]}")
    for lock in s.locks:
        state = "held by " + lock.owner if lock.held else "stale (no process holds it)"
        console.print(f"lock {lock.key}: {state}")
    for path in s.abandoned:
        console.print(f"abandoned staging directory: {path}")
    return 0


def cmd_lookup(args: argparse.Namespace, console: Console) -> int:
    from vllm_aot.cache.keys import arch_digest
    from vllm_aot.cache.registry import describe_rows
    from vllm_aot.cli.args import resolve_model
    from vllm_aot.models.source import load_arch

    arch = load_arch(resolve_model(args.model))
    entries = _cache(args).registry.entries(arch_digest(arch))
    if not entries:
        console.print(
            f"no compiled configuration of {arch.architecture} "
            f"(architecture {arch_digest(arch)}) is cached"
        )
        return 1
    header, *rows = describe_rows(entries)
    table = Table(
        *header,
        title=f"compiled configurations of {arch.architecture} (architecture {arch_digest(arch)})",
    )
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return 0


def cmd_cleanup(args: argparse.Namespace, console: Console) -> int:
    from vllm_aot.cache.admin import cleanup

    removed = cleanup(_cache(args), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for what in removed:
        console.print(f"{verb} {what}")
    console.print(f"{verb} {len(removed)} items")
    return 0


def cmd_sync(args: argparse.Namespace, console: Console) -> int:
    from vllm_aot.cache.admin import sync
    from vllm_aot.loading.prebuilt import sync_artefacts

    push = args.direction in ("push", "both")
    pull = args.direction in ("pull", "both")
    cache = _cache(args)
    try:
        pushed, pulled = sync(cache, push=push, pull=pull, overwrite=args.overwrite)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    console.print(f"{cache.remote.url}: pushed {pushed} programs, pulled {pulled}")
    pushed, pulled = sync_artefacts(cache, push=push, pull=pull)
    console.print(
        f"{cache.remote.url}: pushed {pushed} start-up artefacts (kernels library, bundled "
        f"model, vLLM's model records), pulled {pulled}"
    )
    return 0


ACTIONS = {"status": cmd_status, "lookup": cmd_lookup, "cleanup": cmd_cleanup, "sync": cmd_sync}


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="the compile cache: status, lookup, cleanup, sync")
    p.add_argument("action", choices=list(ACTIONS))
    p.add_argument("model", nargs="?", help="for lookup: HF directory (default: bundled)")
    p.add_argument("--cache-dir", help="local cache (default: VLLM_AOT_COMPILE_CACHE or ~)")
    p.add_argument(
        "--remote",
        help="remote store URL, file:///dir or s3://bucket/prefix (default: VLLM_AOT_REMOTE_CACHE)",
    )
    p.add_argument("--dry-run", action="store_true", help="cleanup: only list")
    p.add_argument(
        "--direction", choices=["push", "pull", "both"], default="both", help="sync: which way"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="sync: push every local program, replacing the store's copy (to sign it with the "
        "current VLLM_AOT_CACHE_SIGNING_KEY)",
    )
    p.set_defaults(func=lambda args: ACTIONS[args.action](args, Console(width=140)))
