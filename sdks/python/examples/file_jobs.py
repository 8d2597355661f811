"""Seed 000's file-job worker: a message names a job; the job's record decides what happens.

- record found -> read the file, process it -> done;
- record deleted (the job was cancelled) -> terminal RecordNotFound: retrying can never help;
- the store failed, or the file is missing -> the exception fails the message: the operator's pass retries it
  (the file may still be on its way), and dead-letters it at the policy's cap.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pelican_worker import Message, Outcome, Worker, run_until_signal


@dataclass(frozen=True)
class Job:
    path: str


class JobStore(Protocol):
    async def get(self, job_id: str) -> Job | None:
        """``None`` when the record does not exist; raises when the store cannot answer."""
        ...


class MemoryStore:
    def __init__(self, jobs: dict[str, Job]) -> None:
        self.jobs = jobs

    async def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)


class FileJobs:
    def __init__(self, store: JobStore) -> None:
        self.store = store

    async def handle(self, message: Message) -> Outcome:
        job_id = message.text("job")
        if job_id is None:
            return Outcome.terminal("MalformedMessage")
        job = await self.store.get(job_id)  # a store failure raises: retried
        if job is None:
            return Outcome.terminal("RecordNotFound")
        data = await asyncio.to_thread(Path(job.path).read_bytes)  # a missing file raises: retried, not terminal
        print(f"job {job_id}: {len(data)} bytes from {job.path}")
        return Outcome.done()


async def main() -> None:
    store = MemoryStore({"1": Job(path="/etc/hostname")})
    worker = Worker(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379"), "file-jobs", "file-workers")
    await run_until_signal(worker, FileJobs(store).handle)


if __name__ == "__main__":
    asyncio.run(main())
