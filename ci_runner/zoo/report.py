"""What the zoo scan found, as data for results.json and the reports: left-out reasons grouped, architectures per
backend (fully supported, or the ops they lack), ops ranked by architectures blocked, the cross-backend table."""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

_VOLATILE = re.compile(r"'[^']*'|\"[^\"]*\"|\b0x[0-9a-f]+\b|\d+(\.\d+)?|/[\w./-]+\.py")


def reason_group(stage: str, reason: str) -> str:
    """The grouping key of a left-out reason: the stage and the message with names, numbers and paths blanked."""
    text = _VOLATILE.sub("…", reason.split(" (e.g.", 1)[0])
    return f"{stage}\x1f{text[:160]}"


def group_reasons(left_out: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """[{stage, reason (the first architecture's own text), models}] by descending count."""
    groups: dict[str, dict[str, Any]] = {}
    for model_type, lo in sorted(left_out.items()):
        stage, reason = str(lo.get("stage", "")), str(lo.get("reason", ""))
        g = groups.setdefault(reason_group(stage, reason), {"stage": stage, "reason": reason, "models": []})
        g["models"].append(model_type)
    return sorted(groups.values(), key=lambda g: (-len(g["models"]), g["stage"], g["reason"]))


def backend_table(uses: Mapping[str, Iterable[str]], verdicts: Mapping[str, str],
                  signatures: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per distinct signature of one backend: {key, op, signature, status (pass | fail | inconclusive; no
    verdict: inconclusive), models (who uses it)}."""
    return [{"key": key, "op": sig["op"], "signature": sig["text"], "status": verdicts.get(key, "inconclusive"),
             "models": sorted(set(uses.get(key, ())))} for key, sig in signatures.items()]


def per_architecture(rows: Iterable[Mapping[str, Any]], scanned: Iterable[str],
                     status: str = "fail") -> dict[str, list[str]]:
    """model_type -> the ops (sorted) with a signature of `status` it uses (failing by default; "inconclusive":
    no verdict, e.g. not run); [] when it uses none."""
    lacks: dict[str, set[str]] = {m: set() for m in scanned}
    for r in rows:
        if r["status"] == status:
            for m in r["models"]:
                lacks.setdefault(m, set()).add(r["op"])
    return {m: sorted(ops) for m, ops in sorted(lacks.items())}


def ops_ranked(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Failing ops by the architectures they block: [{op, models, signatures}], most blocking first."""
    by_op: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["status"] != "fail":
            continue
        e = by_op.setdefault(r["op"], {"op": r["op"], "models": set(), "signatures": 0})
        e["models"] |= set(r["models"])
        e["signatures"] += 1
    out = [{"op": e["op"], "models": sorted(e["models"]), "signatures": e["signatures"]} for e in by_op.values()]
    return sorted(out, key=lambda e: (-len(e["models"]), e["op"]))


def cross_backend(tables: Mapping[str, Iterable[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Op signature × backend: [{op, signature, models, status: {backend: pass|fail|inconclusive|None}}]."""
    rows: dict[str, dict[str, Any]] = {}
    for backend, table in tables.items():
        for r in table:
            row = rows.setdefault(r["key"], {"op": r["op"], "signature": r["signature"], "models": 0, "status": {}})
            row["models"] = max(row["models"], len(r["models"]))
            row["status"][backend] = r["status"]
    for row in rows.values():
        for b in tables:
            row["status"].setdefault(b, None)
    return sorted(rows.values(), key=lambda r: (r["op"], r["signature"]))


def zoo_section(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """results.json's `zoo` from the per-backend zoo records (`<run>/zoo/<backend>.json`)."""
    records = list(records)
    archs: set[str] = set()
    scanned: set[str] = set()
    left: dict[str, str] = {}
    families: dict[str, str] = {}
    tables: dict[str, list[Mapping[str, Any]]] = {}
    backends: dict[str, Any] = {}
    for rec in records:
        b = rec["backend"]
        archs |= set(rec["architectures"])
        scanned |= set(rec["scanned"])
        left.update({m: f"{lo['stage']}: {lo['reason']}" for m, lo in rec["left_out"].items()})
        families.update({m: f for m, f in rec.get("families", {}).items() if f})
        tables[b] = rec["table"]
        lacks = per_architecture(rec["table"], rec["scanned"])
        unsure = per_architecture(rec["table"], rec["scanned"], "inconclusive")
        backends[b] = {"level": rec.get("level"),
                       "supported": sorted(m for m, ops in lacks.items() if not ops and not unsure.get(m)),
                       "lacks": {m: ops for m, ops in lacks.items() if ops},
                       "inconclusive": {m: ops for m, ops in unsure.items() if ops and not lacks.get(m)},
                       "ranked": ops_ranked(rec["table"]),
                       "probe_s": rec.get("probe_s"), "store": rec.get("store", {})}
    groups = group_reasons({m: {"stage": r.split(": ", 1)[0], "reason": r.split(": ", 1)[-1]} for m, r in left.items()})
    return {
        "architectures": len(archs), "scanned": sorted(scanned), "left_out": dict(sorted(left.items())),
        "left_out_groups": groups, "families": dict(sorted(families.items())),
        "signatures": {r["backend"]: int(r.get("distinct", len(r["table"]))) for r in records},
        "probed": {r["backend"]: len(r["table"]) for r in records},
        "pairs": {r["backend"]: int(r["pairs"]) for r in records},
        "backends": backends, "cross": cross_backend(tables),
    }


MAX_CROSS_ROWS = 5000  # rows of the cross-backend table drawn in the page


def zoo_view(zoo: Mapping[str, Any]) -> dict[str, Any]:
    """What the HTML page and the summary show of results.json's `zoo`: coverage, per backend the architectures
    by family (fully supported, or the ops each lacks), ops ranked by architectures blocked, the left-out groups,
    and the cross-backend table (only with several backends)."""
    families = zoo.get("families", {})
    scanned = list(zoo.get("scanned", []))
    backends = []
    for name, b in (zoo.get("backends") or {}).items():
        fams: dict[str, dict[str, Any]] = {}
        lacks, unsure = b.get("lacks", {}), b.get("inconclusive", {})
        for m in scanned:
            f = fams.setdefault(families.get(m) or "other", {"family": families.get(m) or "other", "scanned": 0,
                                                              "supported": 0, "inconclusive": 0, "lacking": []})
            f["scanned"] += 1
            if lacks.get(m):
                f["lacking"].append({"model": m, "ops": lacks[m]})
            elif unsure.get(m):  # no failure, but a signature without a verdict (not run, never executed)
                f["inconclusive"] += 1
            else:
                f["supported"] += 1
        sigs, pairs = (zoo.get("signatures") or {}).get(name, 0), (zoo.get("pairs") or {}).get(name, 0)
        probed = (zoo.get("probed") or {}).get(name, sigs)
        backends.append({"name": name, "level": b.get("level"), "supported": len(b.get("supported", [])),
                         "scanned": len(scanned), "signatures": sigs, "pairs": pairs, "probed": probed,
                         "dedup": round(pairs / sigs, 1) if sigs else None,
                         "families": sorted(fams.values(), key=lambda f: f["family"]),
                         "ranked": list(b.get("ranked", []))})
    cross = list(zoo.get("cross") or [])
    names = [b["name"] for b in backends]
    return {"architectures": zoo.get("architectures", 0), "scanned": len(scanned),
            "left_out": len(zoo.get("left_out") or {}), "groups": list(zoo.get("left_out_groups") or []),
            "backends": backends, "names": names, "cross": cross[:MAX_CROSS_ROWS] if len(names) > 1 else [],
            "cross_total": len(cross), "cross_failing": sum(1 for r in cross if "fail" in r["status"].values())}
