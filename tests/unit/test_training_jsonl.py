"""Loading and validating training JSONL: both OpenAI formats, tool calls, errors with line numbers,
the seeded holdout and builtin data (no Ray, no model)."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import fsspec
import pytest

from serving.redact import redact_uri
from training.jsonl import DataError, holdout, load_jsonl, resolve_data


def _write(path: Path, rows: list[object]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


CHAT = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}], "kind": "plain"}
CALL = {
    "messages": [
        {"role": "user", "content": "add 100 and 5"},
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 100, "b": 5}'}}],
        },
        {"role": "tool", "content": "105"},
        {"role": "assistant", "content": "105"},
    ],
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
}
COMPLETION = {"prompt": "2+2=", "completion": "4", "kind": "completion"}
_ANSWER = '{"role": "assistant", "content": "x"}]}'


def test_both_formats_and_extra_keys(tmp_path: Path) -> None:
    data = load_jsonl(_write(tmp_path / "t.jsonl", [CHAT, "", COMPLETION, CALL]))
    assert [r.format for r in data.rows] == ["chat", "completion", "chat"]
    assert [r.line for r in data.rows] == [1, 3, 4]
    assert data.rows[0].kind == "plain" and data.rows[0].extra == {"kind": "plain"}
    assert data.rows[1].prompt == "2+2=" and data.rows[1].completion == "4"
    assert data.ref.rows == 3 and data.ref.format == "mixed" and len(data.ref.sha256) == 64
    # OpenAI's JSON-string arguments become an object, as a chat template (and vLLM) expects
    call = data.rows[2].messages[1]["tool_calls"][0]  # type: ignore[index]
    assert call["function"]["arguments"] == {"a": 100, "b": 5}
    assert "content" not in data.rows[2].messages[1]  # type: ignore[index]
    assert data.rows[2].tools and data.rows[2].tools[0]["function"]["name"] == "add"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"text": "hi"}', "expected"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "at least one assistant"),
        ('{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}', "role"),
        ('{"prompt": "1+1="}', "completion"),
        (
            '{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]}',
            "arguments are not valid JSON",
        ),
        ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}', "needs content"),
        ('{"messages": [{"role": "user", "content": "hi", "weight": 0}, ' + _ANSWER, "only assistant messages may"),
        ('{"messages": [{"role": "assistant", "content": "x", "weight": 2}]}', "weight must be 0 .* or 1, got 2"),
        ('{"messages": [{"role": "assistant", "content": "x", "weight": true}]}', "weight: Input should be"),
        ('{"messages": [{"role": "assistant", "content": "x", "weight": 0.5}]}', "weight: Input should be"),
        ('{"messages": [{"role": "assistant", "content": "x", "weight": "1"}]}', "weight: Input should be"),
        ('{"messages": [{"role": "assistant", "content": "x", "weight": null}]}', "weight: Input should be"),
        ('{"prompt": "a", "completion": "b", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        ('{"prompt": "\\ud83d", "completion": "b"}', r"lone UTF-16 surrogate escape \\ud83d"),
        ('{"prompt": "a", "completion": "\\udc00 b"}', r"surrogate escape \\udc00"),
        ('{"messages": [' + _ANSWER[:-1] + ', "kind": {"a": ["\\uD800"]}}', r"surrogate escape \\ud800"),
        ('{"prompt": "a", "completion": "b", "\\udbff": 1}', r"surrogate escape \\udbff"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", [CHAT, line])
    with pytest.raises(DataError, match=message) as info:
        load_jsonl(path)
    assert f"{path}:2:" in str(info.value)


def test_weights_and_escaped_pairs_are_read(tmp_path: Path) -> None:
    """OpenAI's ``weight`` (0 or 1) on assistant turns is kept out of the template's messages; a
    surrogate pair's escapes are one character, and an escaped backslash before ``ud83d`` is text."""
    user, again = {"role": "user", "content": "1+1="}, {"role": "user", "content": "again"}
    turns = [{"role": "assistant", "content": "3", "weight": 0}, {"role": "assistant", "content": "2", "weight": 1}]
    chat = {"messages": [user, turns[0], again, turns[1]]}
    pair = {"prompt": "\U0001f600", "completion": "\\ud83d"}
    data = load_jsonl(_write(tmp_path / "t.jsonl", [chat, pair]))
    assert data.rows[0].unweighted == frozenset({1})
    assert all("weight" not in m for m in data.rows[0].messages or [])
    assert data.rows[1].prompt == "\U0001f600" and data.rows[1].completion == "\\ud83d"


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot read"):
        load_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="no rows"):
        load_jsonl(_write(tmp_path / "empty.jsonl", [""]))


def test_fsspec_uri(tmp_path: Path) -> None:
    import fsspec

    with fsspec.open("memory://data/t.jsonl", "w") as fh:
        fh.write(json.dumps(CHAT) + "\n")
    data = load_jsonl("memory://data/t.jsonl")
    assert data.ref.uri == "memory://data/t.jsonl" and data.ref.format == "chat"


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("https://user:pass@host/t.jsonl", "https://host/t.jsonl"),
        (
            "https://b.s3.amazonaws.com/t.jsonl?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=ff",
            "https://b.s3.amazonaws.com/t.jsonl?<redacted>",
        ),
        ("az://c/t.jsonl?sv=1&sig=abc#part", "az://c/t.jsonl?<redacted>#part"),
        ("simplecache::https://tok@h:8080/t.jsonl?sig=1", "simplecache::https://h:8080/t.jsonl?<redacted>"),
        ("s3://bucket/t.jsonl", "s3://bucket/t.jsonl"),
        ("/data/odd?name.jsonl", "/data/odd?name.jsonl"),  # a local path is never touched
        ("403 for url=URL('https://u:p@h/t.jsonl?sig=s')", "403 for url=URL('https://h/t.jsonl?<redacted>')"),
    ],
)
def test_redact_uri(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown == redact_uri(shown)


def test_credentials_in_a_uri_are_never_recorded_or_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [CHAT, COMPLETION, CHAT]
    files = {
        "https://u:p@h/x.jsonl?sig=s": "".join(json.dumps(r) + "\n" for r in rows).encode(),
        "https://u:p@h/bad.jsonl?sig=s": (json.dumps(CHAT) + "\n{not json\n").encode(),
    }

    class Forbidden(Exception):  # what aiohttp raises for a 403 (not an OSError), quoting the URL
        pass

    def fake_open(uri: str, mode: str = "rb") -> io.BytesIO:
        if "expired" in uri:
            raise Forbidden(f"403, message='Forbidden', url='{uri}'")
        if uri not in files:
            raise FileNotFoundError(f"404 Not Found for url: {uri}")
        return io.BytesIO(files[uri])

    monkeypatch.setattr(fsspec, "open", fake_open)
    data = load_jsonl("https://u:p@h/x.jsonl?sig=s")
    assert data.ref.uri == "https://h/x.jsonl?<redacted>" and data.ref.rows == 3
    assert holdout(data, 0)[1].ref.uri == "https://h/x.jsonl?<redacted>#holdout-0.05-seed0"
    with pytest.raises(DataError, match=r"^https://h/bad\.jsonl\?<redacted>:2: not valid JSON") as bad:
        load_jsonl("https://u:p@h/bad.jsonl?sig=s")
    with pytest.raises(DataError, match=r"^cannot read https://h/gone\.jsonl\?<redacted>: 404") as gone:
        load_jsonl("https://u:p@h/gone.jsonl?sig=s")
    with pytest.raises(DataError, match=r"^cannot read https://h/expired\.jsonl\?<redacted>: 403") as expired:
        load_jsonl("https://u:p@h/expired.jsonl?sig=s")
    for text in (data.ref.uri, str(bad.value), str(gone.value), str(expired.value)):
        assert "p@" not in text and "sig" not in text


def test_line_separators_inside_strings(tmp_path: Path) -> None:
    """Only "\\n" ends a line (a CRLF file reads too): U+2028, U+2029 and U+0085 are valid inside
    JSON strings, and str.splitlines split on them."""
    rows = [{"prompt": "a\u2028b", "completion": "x\u0085y"}, {"prompt": "p\u2029", "completion": "c"}, COMPLETION]
    path = tmp_path / "t.jsonl"
    path.write_bytes("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode() + b"\r\n")
    data = load_jsonl(str(path))
    assert [r.line for r in data.rows] == [1, 2, 3]
    assert data.rows[0].prompt == "a\u2028b" and data.rows[0].completion == "x\u0085y"


def test_a_utf8_byte_order_mark_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (COMPLETION, CHAT)), encoding="utf-8-sig")
    assert [r.line for r in load_jsonl(str(path)).rows] == [1, 2]


@pytest.mark.parametrize(("encoding", "line"), [("latin-1", 2), ("utf-16", 1)])
def test_a_file_that_is_not_utf8_names_file_and_line(tmp_path: Path, encoding: str, line: int) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(
        "\n".join(
            [json.dumps(COMPLETION), json.dumps({"prompt": "caf\u00e9", "completion": "1"}, ensure_ascii=False)]
        ).encode(encoding)
    )
    with pytest.raises(DataError, match=f"^{path}:{line}: not UTF-8 .*save it as UTF-8"):
        load_jsonl(str(path))


def test_a_missing_filesystem_package_is_a_data_error() -> None:
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    with pytest.raises(DataError, match=r"cannot read gs://bucket/t.jsonl: its filesystem is not installed .*gcsfs"):
        load_jsonl("gs://bucket/t.jsonl")


def test_holdout_is_seeded_disjoint_and_recorded(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(100)]
    data = load_jsonl(_write(tmp_path / "t.jsonl", rows))
    train, held = holdout(data, seed=1)
    again = holdout(data, seed=1)[1]
    assert len(held.rows) == 5 and len(train.rows) == 95
    assert [r.line for r in held.rows] == [r.line for r in again.rows]
    assert {r.line for r in held.rows} != {r.line for r in holdout(data, seed=2)[1].rows}
    assert not {r.line for r in held.rows} & {r.line for r in train.rows}
    assert held.ref.uri.endswith("#holdout-0.05-seed1") and held.ref.rows == 5
    assert held.ref.sha256 == data.ref.sha256
    with pytest.raises(DataError, match="too few"):
        holdout(load_jsonl(_write(tmp_path / "one.jsonl", rows[:1])), seed=0)


def test_resolve_data_eval_sources(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(40)]
    path = _write(tmp_path / "t.jsonl", rows)
    evals = _write(tmp_path / "e.jsonl", rows[:3])
    assert resolve_data(path, evals, tmp_path / "cache", 0)[2] == "file"
    train, held, how = resolve_data(path, None, tmp_path / "cache", 0)
    assert how == "holdout" and len(held.rows) == 2 and len(train.rows) == 38


def test_builtin_data_is_written_once_and_read_like_a_file(tmp_path: Path) -> None:
    train, evals, how = resolve_data("builtin:max", None, tmp_path, 0)
    assert how == "builtin"
    assert Path(train.ref.uri).parent.name.startswith("max-seed0-") and train.ref.uri.endswith("train.jsonl")
    assert evals.ref.uri.endswith("eval.jsonl") and evals.ref.rows > 0
    assert {r.kind for r in evals.rows} >= {"plain", "completion"}
    again = resolve_data("builtin:max", None, tmp_path, 0)[0]
    assert again.ref.sha256 == train.ref.sha256
    with pytest.raises(DataError, match="unknown builtin task"):
        resolve_data("builtin:mul", None, tmp_path, 0)
