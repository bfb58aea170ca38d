"""The reproducibility stamp's lines at the head of a comparison's results.md (train/compare/stamp.py makes the
stamp): command, git state, versions, device, weights, prompts, workload and intervals."""

from __future__ import annotations

from treespec.train.compare.plots import level_text
from treespec.train.compare.tables import DASH, num


def _short(h: str | None, n: int = 12) -> str:
    return h[:n] if h else DASH


def _model_line(m: dict | None) -> str:
    if not m:
        return DASH
    if m.get("weights", "") is None:
        return f"{m.get('source') or 'no source'}, no weights"
    files = ", ".join(f"{name} sha1 {_short(h)}" for name, h in (m.get("files") or {}).items())
    parts = [m.get("source") or "in-memory model", files, f"weights sha1 {_short(m.get('weights_sha1'))}"]
    return ", ".join(p for p in parts if p)


def stamp_lines(stamp: dict, result: dict, a: dict) -> list[str]:
    if not stamp:
        return ["- **stamp**: none (a results.json written before runs were stamped): command, code, versions, "
                "device, weights and prompts unknown"]
    s = result.get("settings", {})
    git = stamp.get("git") or {}
    if git.get("commit"):
        changed = len(git.get("changed", []))
        dirty = f"dirty: {changed} tracked files changed, diff sha1 {_short(git.get('diff_sha1'))}" \
            if git.get("dirty") else "clean"
        git_text = f"{git['commit'][:12]} ({dirty})"
    else:
        git_text = "not a git checkout"
    v = stamp.get("versions") or {}
    d = stamp.get("device") or {}
    pr = stamp.get("prompts") or {}
    sampling = "greedy" if not s.get("temperature") else f"temperature {s['temperature']}, top-p {s.get('top_p')}"
    b = a["bootstrap"]
    lines = [
        f"- **command**: `{stamp.get('command', DASH)}`",
        f"- **git**: {git_text}",
        "- **versions**: " + " · ".join(f"{k} {v.get(k) or DASH}" for k in ("treespec", "torch", "transformers",
                                                                               "python")),
        f"- **device**: {d.get('device', DASH)} ({d.get('cpu', DASH)}, {d.get('cpu_count', DASH)} cores), "
        f"{d.get('torch_threads', DASH)} torch threads, OMP_NUM_THREADS={d.get('OMP_NUM_THREADS') or 'unset'}"
        + (f", {d['gpu']}" if d.get("gpu") else ""),
        f"- **target**: {_model_line(stamp.get('target'))}",
        "- **drafters**: " + ("; ".join(f"{name}: {_model_line(m)}"
                                        for name, m in (stamp.get("drafters") or {}).items()) or DASH),
        f"- **prompts**: {pr.get('set', DASH)}: {s.get('prompts', DASH)} × {s.get('repeats', DASH)} repeat(s), "
        + (f"up to {s.get('max_new_tokens', DASH)} new tokens each, stopping at end tokens {s['end_token_ids']}"
           if s.get("end_token_ids") else f"{s.get('max_new_tokens', DASH)} new tokens each")
        + f", token ids sha1 {_short(pr.get('token_ids_sha1'))}; {sampling}; "
        f"seed {s.get('seed', stamp.get('seed', DASH))}",
        *workload_lines(stamp),
        f"- **intervals**: bootstrap {level_text(a)} over prompts ({b['samples']} resamples, seed {b['seed']}); "
        "a configuration whose speedup interval overlaps the best one's is *indistinguishable from the best in "
        "this run*",
        f"- **started**: {stamp.get('started', DASH)}, measuring took {num(result.get('wall_s'), '.0f', ' s')}",
    ]
    return lines


def workload_lines(stamp: dict) -> list[str]:
    """The stamp's workload and assisted-peer lines (none for a run from before workloads)."""
    w, peer = stamp.get("workload"), stamp.get("assistant")
    lines = []
    if w:
        sel = ", ".join(f"{k} {v}" for k, v in (w.get("selection") or {}).items() if v not in (None, {}, []))
        lines.append(f"- **workload**: {w.get('source', DASH)}, selected prompts sha1 {_short(w.get('selected_sha1'))}"
                     f" ({w.get('timed_items', DASH)} timed items → {w.get('timed_prompts', DASH)} prompt turns, "
                     f"{w.get('held_out_items', DASH)} held out); template {w.get('template', DASH)}"
                     + (f" (sha1 {_short(w.get('template_sha1'))})" if w.get("template_sha1") else "")
                     + (f", system prompt {w['system_prompt']!r}" if w.get("system_prompt") else "")
                     + f"; selection: {sel or 'defaults'}"
                     + (f"; skipped: {w['skipped']}" if w.get("skipped") else "")
                     + (f"; row formats: {w['formats']}" if w.get("formats") else ""))
    if peer:
        lines.append(f"- **assisted-generation peer**: {peer.get('source')}: "
                     + ("measured" if peer.get("used") else f"not measured ({peer.get('reason')})"))
    if stamp.get("unshipped"):
        lines.append("- **drafters left out** (not shipped in this checkout; skip_unshipped=true): "
                     + ", ".join(f"{label} ({source})" for label, source in stamp["unshipped"].items()))
    return lines
