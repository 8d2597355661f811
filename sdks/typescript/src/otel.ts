/**
 * OpenTelemetry's API when the application has it (an optional peer dependency): loaded, not imported, so that the
 * library runs without it. Traces (`trace.ts`) and metrics (`meter.ts`) go through it.
 */
import { createRequire } from "node:module";
import type * as OpenTelemetry from "@opentelemetry/api";

/** The name of the library's tracer and meter. */
export const INSTRUMENTATION = "pelican";

export const api = loadApi();

function loadApi(): typeof OpenTelemetry | undefined {
  try {
    // The CommonJS build: it shares the global providers, propagator and context manager with the ES one (the API
    // keeps them on `globalThis`), and a synchronous load keeps this module free of top-level await (`require()`).
    return createRequire(import.meta.url)("@opentelemetry/api") as typeof OpenTelemetry;
  } catch {
    return undefined;
  }
}
