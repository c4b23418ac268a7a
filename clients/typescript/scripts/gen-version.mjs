// Writes src/version.ts from package.json's version: the one version of @rtrl/client, named
// on every request (X-Rtrl-Sdk, and User-Agent on Node). `npm version` runs this (the
// "version" script) and stages the file; test/client.test.mjs fails if the two differ.
import { readFileSync, writeFileSync } from "node:fs";

const here = new URL("..", import.meta.url);
const { version } = JSON.parse(readFileSync(new URL("package.json", here), "utf8"));
const source = `// Generated from package.json by scripts/gen-version.mjs (npm version runs it): do not edit.
export const VERSION = ${JSON.stringify(version)};
`;
writeFileSync(new URL("src/version.ts", here), source);
console.log(`src/version.ts: ${version}`);
