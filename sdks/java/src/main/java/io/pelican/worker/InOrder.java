package io.pelican.worker;

import io.lettuce.core.Consumer;
import io.lettuce.core.Limit;
import io.lettuce.core.Range;
import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.StreamMessage;
import io.lettuce.core.XClaimArgs;
import io.lettuce.core.XReadArgs;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.cluster.api.async.RedisClusterAsyncCommands;
import io.lettuce.core.models.stream.PendingMessage;
import java.lang.System.Logger.Level;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.OptionalInt;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.Executor;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.LongAdder;
import java.util.function.BooleanSupplier;

/**
 * One partition of an {@code ordering: PerKey} topic (contract/README.md, "Order per key"): entries dispatched in id
 * order into per-key queues, at most one entry of a key in flight, different keys side by side up to the concurrency.
 * A failure or a retry holds its key: the entry stays pending, this worker's, and runs again in place after the
 * backoff, its delivery counted on the server first ({@code XCLAIM ... RETRYCOUNT n+1 JUSTID}). At the cap it is left
 * to the operator's pass ({@code DeadLetterOnly} on such a topic), which dead-letters it once idle; the key goes on
 * once the entry left this consumer's pending list.
 *
 * <p>One thread (the loop) owns the queues: reads, handler results, due retries and lease ticks come to it as events.
 */
final class InOrder implements PartitionRun {
    private static final System.Logger LOG = System.getLogger("io.pelican.worker");
    /** How many entries are held at once per unit of concurrency: read ahead, so that keys behind a slow one run. */
    private static final int HELD_PER_SLOT = 4;
    private static final Duration READ_MARGIN = Duration.ofSeconds(5);

    private final AbstractRedisClient client;
    private final String stream;
    private final String consumer;
    private final int partition;
    private final int concurrency;
    private final Duration block;
    private final Duration shutdownGrace;
    /** How long a run's entry is leased (the loop's alone). */
    private final MaxHandling maxHandling;
    private final Handler handler;
    private final Executor givenExecutor;
    private final TopicWorker.Spacing spacing;
    private final BooleanSupplier fresh;
    private final byte[] streamKey;
    private final byte[] groupName;
    private final byte[] consumerName;
    private final byte[] errorsKey;
    private final byte[] terminalKey;
    private final byte[] settingsKey;
    private final byte[] consumersKey;
    private final String where;
    /** The names a handler run's span carries. */
    private final Tracing.Where tracedAs;

    private final LongAdder done = new LongAdder();
    private final LongAdder terminal = new LongAdder();
    private final LongAdder failed = new LongAdder();
    private final LongAdder retried = new LongAdder();
    private final LongAdder abandoned = new LongAdder();
    /** The same counts through OpenTelemetry's metrics API, recorded with them. */
    private final Metering.WorkerMeter meter;
    private final CompletableFuture<Void> closed = new CompletableFuture<>();
    private final LinkedBlockingQueue<Runnable> events = new LinkedBlockingQueue<>();
    /** A permit per entry that may still be held: the reader reads no more than there is room for. */
    private final Semaphore room;
    private volatile boolean stopRequested;
    private volatile boolean aborted;
    private volatile ContractVersionException versionMet;
    private volatile int runningNow;

    private Link reader;
    private Link writer;
    private RedisClusterAsyncCommands<byte[], byte[]> writes;
    private ExecutorService ownExecutor;
    private Executor executor;
    private Thread readerThread;
    private Thread loopThread;
    /** The threads running a handler now: interrupted when the partition is lost (guarded by itself). */
    private final Set<Thread> handling = new HashSet<>();
    /** What the read in flight at the stop brought: given back unhandled. */
    private volatile List<String> leftover = List.of();

    // The loop's alone:
    private Settings settings;
    private final Map<String, ArrayDeque<Held>> queues = new HashMap<>();
    private final ArrayDeque<String> ready = new ArrayDeque<>();
    /** Key -> when (nanoTime) its head runs again. */
    private final Map<String, Long> waiting = new HashMap<>();
    private int running;
    /** Past the shutdown's grace: results still coming are ignored, their entries given back. */
    private boolean finished;

    InOrder(AbstractRedisClient client, String stream, String group, String consumer, int partition, int concurrency,
            Duration block, Duration shutdownGrace, Duration maxHandling, Handler handler, Executor executor,
            TopicWorker.Spacing spacing, BooleanSupplier fresh) {
        this.client = client;
        this.stream = stream;
        this.consumer = consumer;
        this.partition = partition;
        this.concurrency = concurrency;
        this.block = block;
        this.shutdownGrace = shutdownGrace;
        this.handler = handler;
        this.givenExecutor = executor;
        this.spacing = spacing;
        this.fresh = fresh;
        this.streamKey = Worker.bytes(stream);
        this.groupName = Worker.bytes(group);
        this.consumerName = Worker.bytes(consumer);
        this.errorsKey = Worker.bytes(Keys.errors(stream, group));
        this.terminalKey = Worker.bytes(Keys.terminal(stream, group));
        this.settingsKey = Worker.bytes(Keys.settings(stream, group));
        this.consumersKey = Worker.bytes(Keys.consumers(stream, group));
        this.room = new Semaphore(concurrency * HELD_PER_SLOT);
        this.where = "[" + stream + " " + group + " " + consumer + " PerKey] ";
        this.tracedAs = new Tracing.Where(stream, group, consumer);
        this.meter = Metering.CURRENT.worker(stream, group);
        this.maxHandling = new MaxHandling(maxHandling, where);
    }

    /** An entry read and not yet done, terminal or dead-lettered. */
    private static final class Held {
        final Message message;
        /** It ran here and failed or asked for a retry: its next run counts a delivery first. */
        boolean failed;
        /** At the cap: no longer leased, left to the pass. */
        boolean capped;
        /** When (nanoTime) its run began; {@code null} while it does not run: leased up to maxHandling. */
        Long runningSince;

        Held(Message message) {
            this.message = message;
        }
    }

    /** How one run of a key's head ended; {@code gone}: the entry was no longer this consumer's before it ran. */
    /** A key's head's run: its outcome or failure, and how long its handler ran (nanoseconds; 0 when it did not). */
    private record Ran(String key, Outcome outcome, Throwable failure, boolean gone, long nanos) {}

    @Override
    public void start() {
        try {
            writer = Link.connect(client);
            writes = writer.async;
            reader = Link.connect(client);
            settings = Settings.parseRaw(await(writes.hgetall(settingsKey)), Set.of(Partitions.TOPIC_CONTRACT_VERSION));
            if (settings == null) {
                throw new SettingsException("partition " + stream + " has no settings");
            }
        } catch (RuntimeException e) {
            release();
            closed.complete(null);
            throw e;
        }
        if (givenExecutor != null) {
            executor = givenExecutor;
        } else {
            ownExecutor = Executors.newFixedThreadPool(concurrency, runnable -> {
                Thread thread = new Thread(runnable, "pelican-handler-" + consumer + "-" + partition);
                thread.setDaemon(true);
                return thread;
            });
            executor = ownExecutor;
        }
        readerThread = new Thread(this::readLoop, "pelican-reader-" + consumer + "-" + partition);
        readerThread.setDaemon(true);
        readerThread.start();
        loopThread = new Thread(this::loop, "pelican-in-order-" + consumer + "-" + partition);
        loopThread.setDaemon(true);
        loopThread.start();
    }

    @Override
    public void close() {
        stopRequested = true;
        events.add(() -> {});
        closed.join();
    }

    /**
     * Stops at once, as a {@link Worker}'s abort does: the handlers running are interrupted, and so is the loop, which
     * may be waiting for a reply that never comes (a member cut off from the server).
     */
    @Override
    public void abort() {
        aborted = true;
        stopRequested = true;
        synchronized (handling) {
            handling.forEach(Thread::interrupt);
        }
        loopThread.interrupt();
    }

    @Override
    public CompletableFuture<Void> whenClosed() {
        return closed.copy();
    }

    @Override
    public WorkerStats stats() {
        return new WorkerStats(done.sum(), terminal.sum(), failed.sum(), retried.sum(), abandoned.sum(), runningNow);
    }

    @Override
    public ContractVersionException versionMet() {
        return versionMet;
    }

    // The loop

    private void loop() {
        long nextLease = System.nanoTime() + Settings.leaseInterval(settings).toNanos();
        try {
            while (!stopRequested) {
                if (!startReady()) {
                    break;
                }
                long now = System.nanoTime();
                long until = nextLease;
                for (long due : waiting.values()) {
                    until = Math.min(until, due);
                }
                Runnable event = events.poll(Math.max(until - now, 0), TimeUnit.NANOSECONDS);
                if (event != null) {
                    event.run();
                }
                now = System.nanoTime();
                for (Iterator<Map.Entry<String, Long>> it = waiting.entrySet().iterator(); it.hasNext(); ) {
                    Map.Entry<String, Long> due = it.next();
                    if (due.getValue() - now <= 0) {
                        it.remove();
                        ready.add(due.getKey());
                    }
                }
                if (nextLease - now <= 0) {
                    hold();
                    nextLease = System.nanoTime() + Settings.leaseInterval(settings).toNanos();
                }
            }
            if (!aborted) {
                shutDown();
            }
        } catch (InterruptedException e) {
            // The abort's (it alone interrupts the loop): stopped below.
        } catch (RuntimeException e) {
            if (!aborted) {
                LOG.log(Level.ERROR, where + "stopped: " + e);
            }
        } finally {
            if (aborted) {
                LOG.log(Level.WARNING, where + "partition lost: stopped at once, its messages left to the new owner");
            }
            stopRequested = true;
            release();
            closed.complete(null);
        }
    }

    /** Starts the ready keys' heads while slots are free; false once the membership is stale (stopped as lost). */
    private boolean startReady() {
        while (running < concurrency && !ready.isEmpty()) {
            if (fresh != null && !fresh.getAsBoolean()) {
                LOG.log(Level.WARNING, where + "no membership heartbeat answered within the ttl: the partition is stopped");
                aborted = true;
                return false;
            }
            String key = ready.poll();
            Held head = queues.get(key).peek();
            head.runningSince = System.nanoTime();
            running++;
            runningNow = running;
            meter.started();
            try {
                executor.execute(() -> {
                    Ran ran = run(key, head);
                    events.add(() -> after(ran));
                });
            } catch (RejectedExecutionException e) {
                LOG.log(Level.WARNING, where + "the handler executor refused to run handlers: " + e);
                aborted = true;
                return false;
            }
        }
        return true;
    }

    /** Puts entries read, in id order, behind their keys: a key is its {@code pelican-key}, or the entry alone. */
    private void enqueue(List<Message> found) {
        for (Message message : found) {
            String key = message.key().map(k -> "k" + k).orElse("i" + message.id());
            ArrayDeque<Held> queue = queues.computeIfAbsent(key, k -> new ArrayDeque<>());
            if (queue.isEmpty()) {
                ready.add(key);
            }
            queue.add(new Held(message));
        }
    }

    /** Runs a key's head, on a handler thread: a run again in place counts its delivery on the server first. */
    private Ran run(String key, Held head) {
        try {
            if (head.failed && !countDelivery(head.message.id())) {
                return new Ran(key, null, null, true, 0);
            }
        } catch (RuntimeException e) {
            return new Ran(key, null, e, false, 0);
        }
        Thread thread = Thread.currentThread();
        synchronized (handling) {
            if (aborted) {
                return new Ran(key, null, null, true, 0);
            }
            handling.add(thread);
        }
        Tracing.Processing processing = Tracing.CURRENT.processing(tracedAs, head.message);
        Ran ran;
        long began = System.nanoTime();
        try {
            Outcome outcome = handler.handle(head.message);
            ran = new Ran(key, outcome,
                    outcome == null ? new IllegalStateException("the handler returned null, not an Outcome") : null, false,
                    System.nanoTime() - began);
        } catch (Throwable e) {
            ran = new Ran(key, null, e, false, System.nanoTime() - began);
        } finally {
            synchronized (handling) {
                handling.remove(thread);
                // An abort's interrupt was this run's: the executor's thread goes on to other work without it.
                Thread.interrupted();
            }
        }
        processing.end(ran.outcome, ran.failure);
        return ran;
    }

    /** Counts a run that took {@code nanos} as {@code ended}, in the stats and their metrics. */
    private void count(Metering.Ended ended, long nanos, Throwable handlerError) {
        LongAdder counter = switch (ended) {
            case DONE -> done;
            case TERMINAL -> terminal;
            case FAILED -> failed;
            case RETRIED -> retried;
        };
        counter.increment();
        meter.ended(ended, nanos, handlerError);
    }

    /** Writes the outcome of a key's head, and lets the key go on, wait or stay at the cap. */
    private void after(Ran ran) {
        running--;
        runningNow = running;
        meter.landed();
        if (aborted || finished) {
            return; // another's now, or given back at the end of the grace
        }
        Held head = queues.get(ran.key).peek();
        head.runningSince = null;
        String id = head.message.id();
        if (ran.gone) {
            pop(ran.key);
            return;
        }
        if (ran.failure == null && ran.outcome.kind() == Outcome.Kind.DONE) {
            try {
                await(writes.xack(streamKey, groupName, id));
                count(Metering.Ended.DONE, ran.nanos, null);
                if (head.failed) {
                    await(writes.hdel(errorsKey, Worker.bytes(id)));
                }
            } catch (RuntimeException e) {
                // The key goes on: the entry stays pending, and whoever takes the partition over runs it again.
                LOG.log(Level.WARNING, where + "XACK of " + id + " failed; the message stays pending: " + e);
            }
            pop(ran.key);
            return;
        }
        if (ran.failure == null && ran.outcome.kind() == Outcome.Kind.TERMINAL) {
            try {
                await(Script.TERMINAL_ACK.<Long>run(writes, ScriptOutputType.INTEGER,
                        new byte[][] {streamKey, terminalKey, errorsKey}, groupName, Worker.bytes(id),
                        Worker.bytes(ran.outcome.reason())));
                count(Metering.Ended.TERMINAL, ran.nanos, null);
            } catch (RuntimeException e) {
                LOG.log(Level.WARNING, where + "terminal ACK of " + id + " failed; the message stays pending: " + e);
            }
            pop(ran.key);
            return;
        }
        if (ran.failure == null) {
            count(Metering.Ended.RETRIED, ran.nanos, null);
        } else {
            String text = Worker.errorText(ran.failure);
            LOG.log(Level.WARNING, where + "handler failed on " + id + " (" + text + "); run again in place after the "
                    + "backoff, its key waits");
            count(Metering.Ended.FAILED, ran.nanos, ran.failure);
            try {
                await(writes.hset(errorsKey, Worker.bytes(id), Worker.bytes(text)));
            } catch (RuntimeException e) {
                LOG.log(Level.WARNING, where + "could not record the last error of " + id + ": " + e);
            }
        }
        head.failed = true;
        PendingMessage pending;
        try {
            pending = pending(id);
        } catch (RuntimeException e) {
            LOG.log(Level.WARNING, where + "could not read the delivery count of " + id + "; run again after the backoff: " + e);
            waiting.put(ran.key, System.nanoTime() + spacing.afterMs(settings.minIdleMs(), 1) * 1_000_000);
            return;
        }
        if (pending == null) {
            pop(ran.key); // no longer this consumer's (the pass took it, the partition moved): the key goes on
            return;
        }
        long deliveries = pending.getRedeliveryCount();
        if (settings.maxDeliveries().isPresent() && deliveries >= settings.maxDeliveries().getAsLong()) {
            LOG.log(Level.INFO, where + id + " at the cap (" + deliveries + " deliveries): left to the operator's pass, "
                    + "which dead-letters it; its key waits");
            head.capped = true;
            return;
        }
        waiting.put(ran.key, System.nanoTime() + spacing.afterMs(settings.minIdleMs(), deliveries) * 1_000_000);
    }

    /** Takes the key's head out; its next entry, if any, is ready. */
    private void pop(String key) {
        ArrayDeque<Held> queue = queues.get(key);
        queue.poll();
        room.release();
        if (queue.isEmpty()) {
            queues.remove(key);
        } else {
            ready.add(key);
        }
    }

    /**
     * A lease tick: re-reads the settings, extends the leases of every entry held but those at the cap and those whose
     * run passed maxHandling (the consumer's heartbeat too), and lets the keys whose capped head left the pending list
     * go on.
     */
    private void hold() {
        try {
            Settings read = Settings.parseRaw(await(writes.hgetall(settingsKey)), Set.of(Partitions.TOPIC_CONTRACT_VERSION));
            if (read != null) {
                settings = read;
            }
        } catch (ContractVersionException e) {
            LOG.log(Level.ERROR, where + e.getMessage() + ": shutting down");
            versionMet = e;
            stopRequested = true;
            return;
        } catch (RuntimeException e) {
            LOG.log(Level.WARNING, where + "could not re-read the settings; the last ones stay: " + e);
        }
        List<String> leased = new ArrayList<>();
        Map<String, Long> runs = new HashMap<>();
        List<String> capped = new ArrayList<>();
        queues.forEach((key, queue) -> {
            queue.forEach(h -> {
                if (h.runningSince != null) {
                    runs.put(h.message.id(), h.runningSince);
                } else if (!h.capped) {
                    leased.add(h.message.id());
                }
            });
            if (queue.peek().capped) {
                capped.add(key);
            }
        });
        leased.addAll(maxHandling.leased(runs, System.nanoTime()));
        try {
            for (int from = 0; from < Math.max(leased.size(), 1); from += Worker.ID_BATCH) {
                List<String> batch = leased.subList(Math.min(from, leased.size()), Math.min(leased.size(), from + Worker.ID_BATCH));
                await(Script.LEASE.<List<?>>run(writes, ScriptOutputType.MULTI, new byte[][] {streamKey, consumersKey},
                        ids(List.of(groupName, consumerName), batch)));
            }
            for (String key : capped) {
                if (pending(queues.get(key).peek().message.id()) == null) {
                    pop(key);
                }
            }
        } catch (RuntimeException e) {
            LOG.log(Level.WARNING, where + "could not extend the leases; retrying at the next tick: " + e);
        }
    }

    /** The entry as this consumer's pending list has it; {@code null} once it is not there. */
    private PendingMessage pending(String id) {
        List<PendingMessage> rows = await(writes.xpending(streamKey, Consumer.from(groupName, consumerName),
                Range.create(id, id), Limit.from(1)));
        return rows.isEmpty() ? null : rows.get(0);
    }

    /** Counts the delivery of a run in place ({@code XCLAIM ... RETRYCOUNT n+1 JUSTID}); false once not this consumer's. */
    private boolean countDelivery(String id) {
        PendingMessage pending = pending(id);
        if (pending == null) {
            return false;
        }
        List<StreamMessage<byte[], byte[]>> claimed = await(writes.xclaim(streamKey,
                Consumer.from(groupName, consumerName),
                XClaimArgs.Builder.minIdleTime(0).retryCount(pending.getRedeliveryCount() + 1).justid(), id));
        return !claimed.isEmpty();
    }

    // Reading

    /** Reads while there is room: the own pending list first (what was taken over), then new entries. */
    private void readLoop() {
        String cursor = "0";
        while (!stopRequested) {
            int count;
            try {
                if (!room.tryAcquire(100, TimeUnit.MILLISECONDS)) {
                    continue;
                }
            } catch (InterruptedException e) {
                return;
            }
            count = 1 + room.drainPermits();
            if (count > Worker.ID_BATCH) {
                room.release(count - Worker.ID_BATCH);
                count = Worker.ID_BATCH;
            }
            List<Message> found;
            try {
                if (cursor != null) {
                    List<StreamMessage<byte[], byte[]>> read = readGroup(XReadArgs.Builder.count(count),
                            StreamOffset.from(streamKey, cursor));
                    cursor = read.isEmpty() ? null : read.get(read.size() - 1).getId();
                    found = Worker.messages(read, OptionalInt.of(partition));
                } else {
                    found = Worker.messages(readGroup(XReadArgs.Builder.count(count).block(block),
                            StreamOffset.lastConsumed(streamKey)), OptionalInt.of(partition));
                }
            } catch (RuntimeException e) {
                room.release(count);
                if (!stopRequested) {
                    LOG.log(Level.WARNING, where + "read failed; retrying: " + e);
                    sleep(500);
                }
                continue;
            }
            room.release(count - found.size());
            if (stopRequested) {
                leftover = found.stream().map(Message::id).toList();
                return;
            }
            if (!found.isEmpty()) {
                events.add(() -> enqueue(found));
            }
        }
    }

    // Lettuce takes the offsets as generic varargs: javac calls the array it makes for one offset unchecked.
    @SuppressWarnings("unchecked")
    private List<StreamMessage<byte[], byte[]>> readGroup(XReadArgs args, StreamOffset<byte[]> from) {
        return reader.sync.xreadgroup(Consumer.from(groupName, consumerName), args, from);
    }

    // Shutdown

    /**
     * As a worker's on SIGTERM: stops reading, lets the handlers running finish within the grace (their outcomes
     * written), then gives back everything else held, uncounted, and leaves the group: the next owner takes the pending
     * list in id order, each key's order kept.
     */
    private void shutDown() throws InterruptedException {
        readerThread.join(block.plus(READ_MARGIN).toMillis());
        for (Runnable event = events.poll(); event != null; event = events.poll()) {
            event.run();
        }
        long deadline = System.nanoTime() + shutdownGrace.toNanos();
        while (running > 0) {
            Runnable event = events.poll(deadline - System.nanoTime(), TimeUnit.NANOSECONDS);
            if (event == null) {
                break;
            }
            event.run();
        }
        finished = true;
        List<String> left = new ArrayList<>(leftover);
        queues.values().forEach(queue -> queue.forEach(h -> {
            if (!h.capped) {
                left.add(h.message.id());
            }
        }));
        try {
            long given = 0;
            for (int from = 0; from < Math.max(left.size(), 1); from += Worker.ID_BATCH) {
                List<String> batch = left.subList(Math.min(from, left.size()), Math.min(left.size(), from + Worker.ID_BATCH));
                given += await(Script.GIVE_BACK.<Long>run(writes, ScriptOutputType.INTEGER, new byte[][] {streamKey},
                        ids(List.of(groupName, consumerName, Worker.bytes(Long.toString(settings.retryAfterMs())),
                                Worker.bytes("1")), batch)));
            }
            abandoned.add(given);
            meter.abandoned(given);
            LOG.log(Level.INFO, where + "shutdown: " + given + " messages given back, their delivery not counted");
        } catch (RuntimeException e) {
            LOG.log(Level.WARNING, where + "could not give back " + left.size() + " messages on shutdown: " + e);
        }
    }

    private void release() {
        if (ownExecutor != null) {
            ownExecutor.shutdownNow();
        }
        if (reader != null) {
            reader.close();
        }
        if (writer != null) {
            writer.close();
        }
    }

    // Helpers

    private static byte[][] ids(List<byte[]> first, List<String> ids) {
        byte[][] args = new byte[first.size() + ids.size()][];
        for (int i = 0; i < first.size(); i++) {
            args[i] = first.get(i);
        }
        for (int i = 0; i < ids.size(); i++) {
            args[first.size() + i] = ids.get(i).getBytes(StandardCharsets.UTF_8);
        }
        return args;
    }

    private static void sleep(long millis) {
        try {
            Thread.sleep(millis);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }

    private <T> T await(CompletionStage<T> call) {
        return Script.await(call, writer.timeout());
    }
}
