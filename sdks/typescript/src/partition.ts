/**
 * One partition of a topic as its owner runs it (contract/README.md, "Taking a partition over"): the partition's
 * whole pending list moved to the member first, then the plain worker's loop, speaking contract 2.
 */

import type { Connection } from "./connection.js";
import { TOPIC_CONTRACT_VERSION } from "./keys.js";
import { Worker, type Handler, type WorkerStats } from "./worker.js";

/** What the topic worker asks of a partition's runner, ordered per key or not. */
export interface PartitionRunner {
  /** Takes the partition over and runs it until `stop()` or `lose()`. */
  run(handler: Handler): Promise<WorkerStats>;
  /** Stops as on SIGTERM: handlers finish within the grace, what is left is given back. */
  stop(): void;
  /** Stops at once, writing nothing: the partition is another member's. */
  lose(): void;
}

/** The most entries one `XAUTOCLAIM` of a take-over moves. */
const TAKE_OVER_BATCH = 100;

/**
 * Moves the partition's whole pending list to `consumer` (`XAUTOCLAIM ... 0 ... JUSTID`, a page at a time from the
 * cursor it answers): the previous owner's entries, this member's own from before, those given back without an
 * owner. The first read of the own pending list then hands them out in id order, each counted as a delivery there,
 * once (`JUSTID` counts none), so that a message that kills its workers still reaches the cap.
 */
export async function takeOver(writer: Connection, stream: string, group: string, consumer: string): Promise<void> {
  let cursor = "0-0";
  do {
    const reply = await writer.call(
      "XAUTOCLAIM",
      stream,
      group,
      consumer,
      0,
      cursor,
      "COUNT",
      TAKE_OVER_BATCH,
      "JUSTID",
    );
    cursor = Array.isArray(reply) ? String(reply[0]) : "0-0";
  } while (cursor !== "0-0");
}

/** The plain worker on one partition (`ordering: None`). */
export class PartitionWorker extends Worker implements PartitionRunner {
  protected override speaks(): readonly number[] {
    return [TOPIC_CONTRACT_VERSION];
  }

  protected override beforeFirstRead(writer: Connection): Promise<void> {
    return takeOver(writer, this.stream, this.group, this.consumer);
  }

  override lose(): void {
    super.lose();
  }
}
