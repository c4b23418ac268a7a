// The builds esbuild makes from tsc's ESM output (dist/): one ESM file for a page's <script
// type="module"> (dist/rtrl-client.browser.js), and the CommonJS builds for require()
// (dist/cjs/node.js, dist/cjs/browser.js: Node 20 cannot require() an ES module). The
// CommonJS builds keep @bufbuild/protobuf external: require() loads its own CommonJS build.
// dist/cjs/package.json makes Node and TypeScript read dist/cjs as CommonJS, the
// declarations tsc wrote there included.
import { writeFileSync } from "node:fs";
import { build } from "esbuild";

const dist = new URL("../dist/", import.meta.url).pathname;
const common = { bundle: true, logLevel: "warning", target: "es2022" };

await Promise.all([
  build({ ...common, entryPoints: [`${dist}browser.js`], format: "esm", platform: "browser",
    outfile: `${dist}rtrl-client.browser.js` }),
  build({ ...common, entryPoints: [`${dist}node.js`], format: "cjs", platform: "node",
    packages: "external", outfile: `${dist}cjs/node.js` }),
  build({ ...common, entryPoints: [`${dist}browser.js`], format: "cjs", platform: "browser",
    packages: "external", outfile: `${dist}cjs/browser.js` }),
]);
writeFileSync(`${dist}cjs/package.json`, JSON.stringify({ type: "commonjs" }) + "\n");
