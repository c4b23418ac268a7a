// Generated from package.json by scripts/gen-version.mjs (npm version runs it): do not edit.
export const VERSION = "0.2.0";
