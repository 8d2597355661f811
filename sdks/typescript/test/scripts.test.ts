/**
 * The package ships the contract's scripts and version (`npm run sync-scripts` copies them from the repository's
 * contract/): checked alone wherever the package is, and byte for byte against contract/ inside the repository.
 */
import assert from "node:assert/strict";
import { existsSync, readFileSync, readdirSync } from "node:fs";
import { test } from "node:test";

import { KNOWN_CONTRACT_VERSIONS } from "../src/index.js";

const packageRoot = new URL("../../", import.meta.url);
/** The repository's contract folder, when the package is tested inside the Pelican repository. */
const contract = new URL("../../contract/", packageRoot);
const SCRIPTS = [
  "bounded_publish.lua",
  "bounded_publish_batch.lua",
  "give_back.lua",
  "lease.lua",
  "membership.lua",
  "terminal_ack.lua",
];

function luaFiles(folder: URL): string[] {
  return readdirSync(folder)
    .filter((name) => name.endsWith(".lua"))
    .sort();
}

test("the package ships the contract's scripts and a version it knows, and says which it knows", () => {
  const manifest = JSON.parse(readFileSync(new URL("package.json", packageRoot), "utf8")) as {
    files: string[];
    pelican: { contractVersions: number[] };
  };
  assert.deepEqual(luaFiles(new URL("scripts/", packageRoot)), SCRIPTS);
  assert.ok(manifest.files.includes("scripts/*.lua") && manifest.files.includes("CONTRACT_VERSION"));
  assert.deepEqual(manifest.pelican.contractVersions, KNOWN_CONTRACT_VERSIONS);
  const version = Number(readFileSync(new URL("CONTRACT_VERSION", packageRoot), "utf8").trim());
  assert.ok(KNOWN_CONTRACT_VERSIONS.includes(version), `CONTRACT_VERSION is ${version}`);
});

test("inside the repository, each copy is the contract's byte for byte", (t) => {
  if (!existsSync(new URL("VERSION", contract))) {
    t.skip("not inside the Pelican repository (no ../../contract): the packaged copies are checked alone");
    return;
  }
  assert.deepEqual(luaFiles(new URL("scripts/", contract)), SCRIPTS);
  for (const name of SCRIPTS) {
    const copy = readFileSync(new URL(`scripts/${name}`, packageRoot));
    const original = readFileSync(new URL(`scripts/${name}`, contract));
    assert.ok(copy.equals(original), `scripts/${name} differs from contract/scripts/${name}: run npm run sync-scripts`);
  }
  const version = readFileSync(new URL("CONTRACT_VERSION", packageRoot));
  assert.ok(version.equals(readFileSync(new URL("VERSION", contract))), "run npm run sync-scripts");
});
