// Copies the contract's scripts into this package, byte for byte: the package ships them (`files`), and
// test/scripts.test.ts fails when a copy differs from ../../contract/scripts.
import { copyFileSync, readdirSync } from "node:fs";
import { fileURLToPath } from "node:url";

const from = fileURLToPath(new URL("../../../contract/scripts/", import.meta.url));
const to = fileURLToPath(new URL("../scripts/", import.meta.url));
for (const name of readdirSync(from)
  .filter((n) => n.endsWith(".lua"))
  .sort()) {
  copyFileSync(from + name, to + name);
  console.log(`scripts/${name}`);
}
