/** The package's scripts are the contract's, byte for byte (`npm run sync-scripts` copies them). */
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { test } from "node:test";

import { KNOWN_CONTRACT_VERSIONS } from "../src/index.js";

const packageRoot = new URL("../../", import.meta.url);
const contract = new URL("../../contract/", packageRoot);

function luaFiles(folder: URL): string[] {
  return readdirSync(folder)
    .filter((name) => name.endsWith(".lua"))
    .sort();
}

test("every contract script is shipped, and each copy is identical", () => {
  const theirs = luaFiles(new URL("scripts/", contract));
  assert.ok(theirs.length >= 5, `contract scripts: ${theirs.join(", ")}`);
  assert.deepEqual(luaFiles(new URL("scripts/", packageRoot)), theirs);
  for (const name of theirs) {
    const copy = readFileSync(new URL(`scripts/${name}`, packageRoot));
    const original = readFileSync(new URL(`scripts/${name}`, contract));
    assert.ok(copy.equals(original), `scripts/${name} differs from contract/scripts/${name}: run npm run sync-scripts`);
  }
});

test("the package ships its scripts and says which contract versions it knows", () => {
  const manifest = JSON.parse(readFileSync(new URL("package.json", packageRoot), "utf8")) as {
    files: string[];
    pelican: { contractVersions: number[] };
  };
  assert.ok(manifest.files.includes("scripts/*.lua"));
  assert.deepEqual(manifest.pelican.contractVersions, KNOWN_CONTRACT_VERSIONS);
  const version = Number(readFileSync(new URL("VERSION", contract), "utf8").trim());
  assert.ok(KNOWN_CONTRACT_VERSIONS.includes(version), `contract/VERSION is ${version}`);
});
