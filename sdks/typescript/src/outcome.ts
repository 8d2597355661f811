/** How a handler ends a message (contract/README.md, "Outcomes"). A thrown error is a failure, not an outcome. */

/** A terminal reason: CamelCase, as the operator's own (`RecordNotFound`). */
export const REASON_PATTERN = /^[A-Z][A-Za-z0-9]{0,62}$/;

export class InvalidReasonError extends Error {
  override readonly name = "InvalidReasonError";
  constructor(readonly reason: string) {
    super(`invalid terminal reason ${JSON.stringify(reason)}: a reason must be CamelCase, ${REASON_PATTERN.source}`);
  }
}

export type Outcome =
  /** Processed: acknowledge. */
  | { readonly kind: "done" }
  /** Failed, retry it under the policy's backoff: given back to the operator's pass, the delivery counted. */
  | { readonly kind: "retry" }
  /** Will never succeed (the record it refers to is gone): acknowledge and count under `reason`. */
  | { readonly kind: "terminal"; readonly reason: string };

const DONE: Outcome = Object.freeze({ kind: "done" });
const RETRY: Outcome = Object.freeze({ kind: "retry" });

export function done(): Outcome {
  return DONE;
}

export function retry(): Outcome {
  return RETRY;
}

/**
 * Ends the message as terminal under `reason`. An invalid reason throws here, inside the handler, so the message
 * fails (no ACK) rather than being acknowledged under a code the operator cannot count.
 */
export function terminal(reason: string): Outcome {
  validateReason(reason);
  return Object.freeze({ kind: "terminal", reason });
}

export function validateReason(reason: string): void {
  if (!REASON_PATTERN.test(reason)) throw new InvalidReasonError(reason);
}

/** Whether a handler's value is an outcome (it may be anything at run time), its reason checked again. */
export function checkOutcome(value: unknown): Outcome {
  if (typeof value === "object" && value !== null && "kind" in value) {
    const outcome = value as Outcome;
    if (outcome.kind === "done" || outcome.kind === "retry") return outcome;
    if (outcome.kind === "terminal") {
      validateReason(String(outcome.reason));
      return outcome;
    }
  }
  throw new TypeError(
    `the handler resolved to ${describe(value)}, not an outcome: return done(), retry() or terminal(reason)`,
  );
}

function describe(value: unknown): string {
  try {
    return JSON.stringify(value) ?? String(value);
  } catch {
    return typeof value;
  }
}
