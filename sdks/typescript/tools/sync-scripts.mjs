// Copies the contract's scripts and VERSION into this package, byte for byte: the package ships them (`files`),
// and test/scripts.test.ts fails inside the repository when a copy differs from ../../contract.
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
copyFileSync(
  fileURLToPath(new URL("../../../contract/VERSION", import.meta.url)),
  fileURLToPath(new URL("../CONTRACT_VERSION", import.meta.url)),
);
console.log("CONTRACT_VERSION");
