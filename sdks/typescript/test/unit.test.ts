/** What needs no server: key names, settings, reasons, outcomes, error text, publish error classes. */
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  ContractVersionError,
  InvalidReasonError,
  Message,
  PublishFailed,
  PublishOutcomeUnknown,
  PublishRefused,
  PublishUnavailable,
  done,
  errorsKey,
  hashTag,
  leaseIntervalMs,
  parseSettings,
  rejectedKey,
  settingsKey,
  terminal,
  terminalKey,
  boundsKey,
} from "../src/index.js";
import { checkOutcome } from "../src/outcome.js";
import { classify, commandTokens } from "../src/producer.js";
import { cutUtf8 } from "../src/worker.js";

test("the hash tag is the first non-empty {...}, else the whole name", () => {
  assert.equal(hashTag("{orders}:events"), "orders");
  assert.equal(hashTag("a{b}c{d}"), "b");
  assert.equal(hashTag("{a{b}x"), "a{b");
  assert.equal(hashTag("notifications"), "notifications");
  assert.equal(hashTag("empty{}tag"), "empty{}tag");
  assert.equal(hashTag("open{only"), "open{only");
});

test("key names are the contract's, in the stream's slot", () => {
  assert.equal(terminalKey("{orders}:events", "billing"), "{orders}:pelican:{orders}:events:billing:terminal");
  assert.equal(settingsKey("jobs", "g"), "{jobs}:pelican:jobs:g:settings");
  assert.equal(errorsKey("jobs", "g"), "{jobs}:pelican:jobs:g:errors");
  assert.equal(boundsKey("{orders}:events"), "{orders}:pelican:{orders}:events:bounds");
  assert.equal(rejectedKey("jobs"), "{jobs}:pelican:jobs:rejected");
});

test("settings are parsed by field name; a missing contractVersion is 1", () => {
  const settings = parseSettings({ maxDeliveries: "5", minIdleMs: "30000", retryAfterMs: "60000", other: "x" });
  assert.deepEqual(settings, { contractVersion: 1, minIdleMs: 30000, retryAfterMs: 60000, maxDeliveries: 5 });
  assert.deepEqual(parseSettings({}), { contractVersion: 1 });
  assert.deepEqual(parseSettings({ minIdleMs: "soon", contractVersion: "1" }), { contractVersion: 1 });
});

test("an unknown contract version is refused with both versions and what to do", () => {
  assert.equal(parseSettings({ contractVersion: "1" }).contractVersion, 1);
  assert.throws(
    () => parseSettings({ contractVersion: "2" }),
    (error: unknown) =>
      error instanceof ContractVersionError &&
      error.operatorVersion === "2" &&
      error.message ===
        "the operator speaks worker contract 2, this library knows 1: upgrade the library " + "(@pelican-io/worker)",
  );
});

test("only ASCII digits are a version, read first, before any other field", () => {
  for (const version of ["2.0", " 1", "1x", "", "0x1", "1.0"]) {
    assert.throws(
      // The other fields unreadable: the version is what the error names all the same.
      () => parseSettings({ minIdleMs: "soon", retryAfterMs: "-", contractVersion: version }),
      (error: unknown) => error instanceof ContractVersionError && error.operatorVersion === version,
      JSON.stringify(version),
    );
  }
});

test("leases tick at min(minIdle / 3, 10 s), at least every 100 ms, every second without settings", () => {
  assert.equal(leaseIntervalMs(undefined), 1000);
  assert.equal(leaseIntervalMs({ contractVersion: 1 }), 1000);
  assert.equal(leaseIntervalMs({ contractVersion: 1, minIdleMs: 900 }), 300);
  assert.equal(leaseIntervalMs({ contractVersion: 1, minIdleMs: 300_000 }), 10_000);
  assert.equal(leaseIntervalMs({ contractVersion: 1, minIdleMs: 60 }), 100);
});

test("terminal reasons must be CamelCase; anything else throws before anything is written", () => {
  assert.deepEqual(terminal("RecordNotFound"), { kind: "terminal", reason: "RecordNotFound" });
  assert.deepEqual(terminal(`A${"b".repeat(62)}`).kind, "terminal");
  for (const bad of ["", "recordNotFound", "Record_Not_Found", "Record Not", "Ünicode", `A${"b".repeat(63)}`]) {
    assert.throws(() => terminal(bad), InvalidReasonError, bad);
  }
  // An outcome built by hand is checked again at dispatch.
  assert.throws(() => checkOutcome({ kind: "terminal", reason: "not camel" }), /\^\[A-Z\]\[A-Za-z0-9\]\{0,62\}\$/);
  assert.throws(() => checkOutcome(undefined), /not an outcome/);
  assert.equal(checkOutcome(done()).kind, "done");
});

test("error text is cut to 1,024 bytes at a character boundary", () => {
  assert.equal(cutUtf8("short", 1024), "short");
  const cut = cutUtf8("a" + "é".repeat(600), 1024); // 1 + 1,200 bytes
  assert.equal(Buffer.byteLength(cut), 1023);
  assert.ok(cut.endsWith("é"));
  assert.equal(Buffer.byteLength(cutUtf8("€".repeat(400), 1024)), 1023);
});

test("messages keep raw bytes in order, the first value of a repeated name", () => {
  const message = new Message("1-0", [
    [Buffer.from("a"), Buffer.from([0xff])],
    [Buffer.from("a"), Buffer.from("2")],
    [Buffer.from("job"), Buffer.from("42")],
  ]);
  assert.deepEqual(message.fieldBuffer("a"), Buffer.from([0xff]));
  assert.equal(message.field("job"), "42");
  assert.equal(message.field("b"), undefined);
  assert.equal(message.pairs.length, 3);
});

function replyError(message: string): Error {
  const error = new Error(message);
  error.name = "ReplyError";
  return error;
}

test("publish errors are classified: refused, unavailable, failed, unknown", () => {
  const refused = classify(replyError("PELICAN_BACKLOG_FULL my group 10 10"));
  assert.ok(refused instanceof PublishRefused);
  assert.deepEqual([refused.group, refused.backlog, refused.max], ["my group", 10, 10]);
  for (const code of ["READONLY You can't write", "LOADING", "MASTERDOWN x", "BUSY script", "TRYAGAIN"]) {
    assert.ok(classify(replyError(code)) instanceof PublishUnavailable, code);
  }
  assert.ok(classify(replyError("WRONGTYPE Operation against a key")) instanceof PublishFailed);
  assert.ok(
    classify(replyError("PELICAN_PARTIAL 2 of 5 entries written before: OOM")) instanceof PublishOutcomeUnknown,
  );
  assert.ok(
    classify(new Error("Stream isn't writeable and enableOfflineQueue options is false")) instanceof PublishUnavailable,
  );
  const unknown = classify(new Error("Connection is closed."));
  assert.ok(unknown instanceof PublishOutcomeUnknown);
  assert.equal(unknown.certainlyNotWritten, false);
  assert.ok(classify(new Error("Command timed out")) instanceof PublishOutcomeUnknown);
});

test("IDMP is found among XADD's tokens at any depth, not in other commands", () => {
  const docs = [
    "xadd",
    [
      "summary",
      "Appends a new message",
      "arguments",
      [
        ["name", "key", "type", "key"],
        ["name", "idmp-block", "type", "block", "arguments", [["name", "idmp", "type", "pure-token", "token", "IDMP"]]],
      ],
    ],
    "xack",
    ["arguments", [["name", "x", "token", "NOMKSTREAM"]]],
  ];
  assert.ok(commandTokens(docs, "xadd").has("IDMP"));
  assert.ok(!commandTokens(docs, "xadd").has("NOMKSTREAM"));
  assert.ok(!commandTokens(["xadd", ["summary", "IDMP in a sentence is no token"]], "xadd").has("IDMP"));
});
