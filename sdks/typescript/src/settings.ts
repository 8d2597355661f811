/** The group's settings hash, as the operator publishes it (contract/README.md, "Settings"). */

/** The worker contract versions this library implements. */
export const KNOWN_CONTRACT_VERSIONS: readonly number[] = [1];

/** The idle time given back entries get when no settings are published: Pelican's default `minIdle`. */
export const UNPUBLISHED_IDLE_MS = 300_000;

export interface WorkerSettings {
  /** An entry idle this long is taken by the operator's pass. */
  minIdleMs?: number;
  /** An idle time every retry threshold of the policy allows: what a shutdown gives entries back with. */
  retryAfterMs?: number;
  /** The retry cap; shown, never enforced here (the pass does). */
  maxDeliveries?: number;
  /** The contract the operator speaks; a hash without it was written before the contract had a version: 1. */
  contractVersion: number;
}

/** The operator speaks a contract version this library does not know. */
export class ContractVersionError extends Error {
  override readonly name = "ContractVersionError";
  /**
   * `contractVersion` as the operator wrote it (`2`, or `2.0`: only digits are a version this library may know),
   * and the versions the reader knew (a topic's partitions speak 2).
   */
  constructor(
    readonly operatorVersion: string,
    known: readonly number[] = KNOWN_CONTRACT_VERSIONS,
  ) {
    super(
      `the operator speaks worker contract ${operatorVersion}, this library knows ` +
        `${known.join(", ")}: upgrade the library (@pelican-io/worker)`,
    );
  }
}

/**
 * Reads an `HGETALL` reply field by field, by name. The contract version first, on its own: only ASCII digits are
 * a version, and one this library does not know throws a `ContractVersionError` whatever the other fields hold
 * (without the field: version 1). Any other field that is missing or not a decimal number is left out, so each use
 * falls back on its own default (see `leaseIntervalMs`, `UNPUBLISHED_IDLE_MS`). `known`: the versions the reader
 * speaks (a partition of a topic: 2 only).
 */
export function parseSettings(
  hash: Record<string, string>,
  known: readonly number[] = KNOWN_CONTRACT_VERSIONS,
): WorkerSettings {
  const version = hash["contractVersion"];
  if (version !== undefined && !(/^\d+$/.test(version) && known.includes(Number(version)))) {
    throw new ContractVersionError(version, known);
  }
  const number = (name: string): number | undefined => {
    const text = hash[name];
    return text !== undefined && /^\d+$/.test(text) ? Number(text) : undefined;
  };
  const settings: WorkerSettings = { contractVersion: version === undefined ? 1 : Number(version) };
  const minIdleMs = number("minIdleMs");
  const retryAfterMs = number("retryAfterMs");
  const maxDeliveries = number("maxDeliveries");
  if (minIdleMs !== undefined) settings.minIdleMs = minIdleMs;
  if (retryAfterMs !== undefined) settings.retryAfterMs = retryAfterMs;
  if (maxDeliveries !== undefined) settings.maxDeliveries = maxDeliveries;
  return settings;
}

/**
 * How often leases are extended: `min(minIdleMs / 3, 10 s)`, never more often than every 100 ms; every second
 * without settings. A third of `minIdle` keeps an entry in flight from ever looking idle half of it.
 */
export function leaseIntervalMs(settings: WorkerSettings | undefined): number {
  const minIdleMs = settings?.minIdleMs;
  if (minIdleMs === undefined) return 1000;
  return Math.max(100, Math.min(Math.floor(minIdleMs / 3), 10_000));
}
