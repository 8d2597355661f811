package io.pelican.worker;

import io.lettuce.core.Consumer;
import io.lettuce.core.Limit;
import io.lettuce.core.Range;
import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisCommandExecutionException;
import io.lettuce.core.RedisException;
import io.lettuce.core.RedisURI;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.StreamMessage;
import io.lettuce.core.XReadArgs;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.async.RedisClusterAsyncCommands;
import io.lettuce.core.models.stream.PendingMessage;
import java.lang.System.Logger.Level;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.Optional;
import java.util.OptionalInt;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.Executor;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.Semaphore;
import java.util.concurrent.ThreadFactory;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.LongAdder;
import java.util.function.BooleanSupplier;

/**
 * The dispatch layer of an application consumer, as the worker contract's checklist says: reads its own PEL first,
 * then new entries, runs at most {@code concurrency} handlers, holds a lease on every entry in flight, takes up
 * hand-overs, gives back on shutdown, and is the only place that acknowledges.
 *
 * <pre>{@code
 * Worker worker = Worker.builder(RedisURI.create("redis://localhost:6379"))
 *         .stream("files").group("converters")
 *         .handler(message -> Outcome.done())
 *         .build();
 * worker.start();   // throws ContractVersionException before reading anything when the operator is newer
 * ...
 * worker.close();   // stops reading, lets handlers finish within shutdownGrace, gives back the rest
 * }</pre>
 *
 * <p>A plain bean for Spring: {@code @Bean(initMethod = "start", destroyMethod = "close")}.
 */
public final class Worker implements AutoCloseable {
    private static final System.Logger LOG = System.getLogger("io.pelican.worker");
    /** The most ids one lease or give-back call carries. */
    static final int ID_BATCH = 100;
    /** How much shorter than the time since it failed here an entry's idle must be to count as handed back. */
    static final long HAND_OVER_MARGIN_MS = 1000;
    /** How many ids of recorded errors are remembered, to remove each with its message's ACK. */
    static final int ERRORS_REMEMBERED = 10_000;
    /**
     * How long a message read may wait for a thread busy with another handler before it gets one of its own: handlers
     * that take microseconds run one after another on the thread already awake (waking a thread per message costs
     * more than they do), slow ones each on their own thread after at most this wait.
     */
    private static final long QUEUE_WAIT_NANOS = 1_000_000;
    /** The most ids one batched XACK carries. */
    private static final int MAX_ACK_BATCH = 1000;
    /** How long the read in flight at a stop is awaited beyond {@code block}. */
    private static final Duration READ_MARGIN = Duration.ofSeconds(5);

    private enum State {
        NEW,
        RUNNING,
        CLOSING,
        CLOSED
    }

    /** The application's client; {@code null} when the worker makes its own ({@link #uri}) at start. */
    private final AbstractRedisClient givenClient;
    private final RedisURI uri;
    private final String stream;
    private final String group;
    private final String consumer;
    private final int concurrency;
    private final Duration block;
    private final Duration shutdownGrace;
    /** How long a handler's entry is leased (the lease thread's alone). */
    private final MaxHandling maxHandling;
    private final Handler handler;
    private final Executor givenExecutor;
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
    /**
     * A topic's partition ({@link TopicWorker}): the contract versions its settings may say, the partition its
     * messages carry (empty for a plain stream), and whether the membership is fresh (false: the partition may be
     * another's, no handler starts and the worker stops as lost).
     */
    private final Set<Integer> contracts;
    private final OptionalInt partition;
    private final BooleanSupplier fresh;
    /** The partition was lost: no handler starts, no outcome is written, nothing is given back. */
    private volatile boolean aborted;

    private final LongAdder done = new LongAdder();
    private final LongAdder terminal = new LongAdder();
    private final LongAdder failed = new LongAdder();
    private final LongAdder retried = new LongAdder();
    private final LongAdder abandoned = new LongAdder();
    /** The same counts through OpenTelemetry's metrics API, recorded with them. */
    private final Metering.WorkerMeter meter;
    private final Map<String, InFlight> inFlight = new ConcurrentHashMap<>();
    /**
     * Entry id -> since when (nanoTime) it is untouched on the server as this worker left it after its handler failed
     * or asked for a retry here (a retry's set back by the idle time its give-back writes): the pass retries it, never
     * this worker.
     */
    private final Map<String, Long> failedHere = new ConcurrentHashMap<>();
    /**
     * Held by a lease tick from gathering its ids to the end of its take-up of hand-overs, and by a retry from its mark
     * to its give-back's reply (released on the client's thread, hence a semaphore). A retry's give-back (which sets
     * the entry's idle time) must reach the server after a lease that gathered its id (which would undo that idle
     * time), and not be answered while the own PEL's XPENDING is out (its idle times from before it): either way the
     * entry would look handed back and be run again here, no delivery counted. The connection serves calls in the
     * order they are put on it, but that is not the order of clocks read before them on two threads.
     */
    private final Semaphore leasing = new Semaphore(1);
    /** Entries whose last error this worker recorded: the field goes with their ACK. */
    private final Set<String> errorsRecorded = ConcurrentHashMap.newKeySet();
    private final Acks acks = new Acks();
    /** Messages read and not started yet, in order; the drainers (tasks on the executor) take them one by one. */
    private final ConcurrentLinkedQueue<Queued> queued = new ConcurrentLinkedQueue<>();
    /** The drainers running: at most {@code concurrency}. */
    private final AtomicInteger drainers = new AtomicInteger();

    /**
     * Guards {@link #running} (the messages read and not finished: queued or in a handler) and wakes the reader when a
     * slot frees or the worker stops.
     */
    private final Object slots = new Object();
    private int running;
    private final Object lifecycle = new Object();
    private State state = State.NEW;
    private final CompletableFuture<Void> closed = new CompletableFuture<>();
    private volatile boolean stopping;
    /** Set once the read loop read its own PEL to the end: hand-overs are looked for from then on. */
    private volatile boolean ownPelRead;
    /**
     * When (nanoTime) the read in flight was sent; {@code null} once what it brought is in flight. An entry delivered
     * since may be that read's, not a hand-over.
     */
    private volatile Long readSentAt;
    /** Counted down by the stop: ends the read loop's pauses at once. */
    private final CountDownLatch stopSignal = new CountDownLatch(1);

    private volatile Settings settings;
    /** The last problem with the settings, said once each. */
    private volatile String settingsProblem;
    /** An unknown contract version met at a lease tick: the worker shuts down, and {@link #run()} throws it. */
    private volatile ContractVersionException versionMet;
    private RedisClient ownClient;
    private Link reader;
    private Link writer;
    private RedisClusterAsyncCommands<byte[], byte[]> writes;
    private ExecutorService ownExecutor;
    private Executor executor;
    private ScheduledExecutorService leaser;
    private Thread readerThread;
    /** What the read in flight at the stop brought: delivered to this consumer, never started, given back. */
    private volatile List<String> unhandled = List.of();

    private Worker(Builder b) {
        this.givenClient = b.client;
        this.uri = b.uri;
        this.stream = b.stream;
        this.group = b.group;
        this.consumer = b.consumer != null ? b.consumer : PodName.get();
        this.concurrency = b.concurrency;
        this.block = b.block;
        this.shutdownGrace = b.shutdownGrace;
        this.handler = b.handler;
        this.givenExecutor = b.executor;
        this.streamKey = bytes(stream);
        this.groupName = bytes(group);
        this.consumerName = bytes(consumer);
        this.errorsKey = bytes(Keys.errors(stream, group));
        this.terminalKey = bytes(Keys.terminal(stream, group));
        this.settingsKey = bytes(Keys.settings(stream, group));
        this.consumersKey = bytes(Keys.consumers(stream, group));
        this.where = "[" + stream + " " + group + " " + consumer + "] ";
        this.maxHandling = new MaxHandling(b.maxHandling, where);
        this.tracedAs = new Tracing.Where(stream, group, consumer);
        this.meter = Metering.CURRENT.worker(stream, group);
        this.contracts = b.partition.isPresent() ? Set.of(Partitions.TOPIC_CONTRACT_VERSION) : Settings.KNOWN_CONTRACT_VERSIONS;
        this.partition = b.partition;
        this.fresh = b.fresh;
    }

    /** A worker on a client of the application's (its options and resources are used as they are; never shut down). */
    public static Builder builder(RedisClient client) {
        return new Builder(Objects.requireNonNull(client, "client"), null);
    }

    /**
     * A worker on a Redis Cluster client of the application's (never shut down): every key the worker names lives in
     * the stream's slot, so each call goes to the shard that has the stream.
     */
    public static Builder builder(RedisClusterClient client) {
        return new Builder(Objects.requireNonNull(client, "client"), null);
    }

    /** A worker on either kind of client of the application's: a topic's partition. */
    static Builder on(AbstractRedisClient client) {
        return new Builder(client, null);
    }

    /** A worker with a client of its own, shut down by {@link #close()}. */
    public static Builder builder(RedisURI uri) {
        return new Builder(null, Objects.requireNonNull(uri, "uri"));
    }

    public String stream() {
        return stream;
    }

    public String group() {
        return group;
    }

    public String consumer() {
        return consumer;
    }

    /** The group's settings as last read; empty when none are published (or they cannot be read). */
    public Optional<Settings> settings() {
        return Optional.ofNullable(settings);
    }

    public WorkerStats stats() {
        return new WorkerStats(done.sum(), terminal.sum(), failed.sum(), retried.sum(), abandoned.sum(), inFlight.size());
    }

    /**
     * Connects (two connections: the blocking reads have one of their own, so leases, ACKs and give-backs never queue
     * behind them), reads the group's settings, and starts reading in the background. Read errors afterwards (a
     * server restarting, a group not created yet) are logged and retried; they never stop the worker.
     *
     * @throws ContractVersionException before anything is read when the operator speaks a contract version this
     *     library does not know
     * @throws RedisException when the server cannot be reached or the settings cannot be read
     * @throws IllegalArgumentException on a client of the application's, when {@code block} is not below its timeout
     * @throws IllegalStateException when the worker was started or closed before
     */
    public void start() {
        synchronized (lifecycle) {
            if (state != State.NEW) {
                throw new IllegalStateException("a worker starts once: build a new one");
            }
            try {
                AbstractRedisClient client = givenClient;
                if (client == null) {
                    ownClient = RedisClient.create(uri);
                    client = ownClient;
                }
                writer = Link.connect(client);
                writes = writer.async;
                reader = Link.connect(client);
                Builder.checkBlock(block, reader.timeout()); // an application's client: known once connected
                refreshSettings(true);
            } catch (RuntimeException e) {
                state = State.CLOSED;
                release();
                closed.complete(null);
                throw e;
            }
            if (givenExecutor != null) {
                executor = givenExecutor;
            } else {
                ownExecutor = Executors.newFixedThreadPool(concurrency, threads("pelican-handler-" + consumer + "-", true));
                executor = ownExecutor;
            }
            leaser = Executors.newSingleThreadScheduledExecutor(threads("pelican-lease-" + consumer, true));
            scheduleLease();
            // Not a daemon: a program whose main() only starts the worker runs until close().
            readerThread = threads("pelican-reader-" + consumer, false).newThread(this::readLoop);
            readerThread.start();
            state = State.RUNNING;
        }
    }

    /**
     * {@link #start()}, then waits until the worker is closed ({@link #close()} from another thread: a shutdown hook),
     * for a program whose main thread has nothing else to do.
     *
     * @throws ContractVersionException before anything is read when the operator speaks a contract version this
     *     library does not know; or, once the worker shut down gracefully, when it started to while the worker ran
     * @throws RedisException when the server cannot be reached or the settings cannot be read
     * @throws IllegalStateException when the worker was started or closed before
     */
    public void run() {
        start();
        closed.join();
        ContractVersionException met = versionMet;
        if (met != null) {
            throw new ContractVersionException(met.operatorVersion(), met.known());
        }
    }

    /**
     * The contract's shutdown: stops reading (a blocking read already sent is awaited, and what it brought is given
     * back unhandled), keeps leasing, lets handlers finish within {@code shutdownGrace}, interrupts the ones still
     * running, then gives back what is left with {@code give_back.lua} (uncounted, without an owner) and leaves the
     * group (the same call deletes the consumer once it owns nothing). Then closes its connections. Idempotent; a
     * second caller waits for the first.
     */
    @Override
    public void close() {
        boolean shutDownHere;
        synchronized (lifecycle) {
            if (state == State.NEW) {
                state = State.CLOSED;
                closed.complete(null);
            }
            shutDownHere = state == State.RUNNING;
            if (shutDownHere) {
                state = State.CLOSING;
            }
        }
        if (!shutDownHere) {
            closed.join(); // closed, or being closed by another thread
            return;
        }
        try {
            shutDown();
        } finally {
            release();
            synchronized (lifecycle) {
                state = State.CLOSED;
            }
            closed.complete(null);
        }
    }

    // Settings

    /**
     * Reads the settings hash. A refusal (an ACL without {@code hgetall} on it) or a malformed hash leaves the worker
     * without settings (it leases every second), said once; a broken connection throws and keeps the last ones. An
     * unknown contract version throws at start; at a lease tick it is said once and the worker shuts down as on
     * {@link #close()}, on a thread of its own (never another handler starts), and {@link #run()} throws it.
     */
    private void refreshSettings(boolean starting) {
        Settings read;
        String problem = null;
        try {
            read = Settings.parseRaw(await(writes.hgetall(settingsKey)), contracts);
        } catch (RedisCommandExecutionException | SettingsException e) {
            read = null;
            problem = e.getMessage();
        } catch (ContractVersionException e) {
            if (starting) {
                throw e;
            }
            if (versionMet == null) {
                versionMet = e;
                LOG.log(Level.ERROR, where + e.getMessage() + ": shutting down");
                threads("pelican-shutdown-" + consumer, false).newThread(this::close).start();
            }
            return;
        }
        if (problem != null && !problem.equals(settingsProblem)) {
            LOG.log(Level.WARNING, where + "no usable settings for the group (" + problem + "): leasing every second, "
                    + "giving back with an idle of " + Settings.UNPUBLISHED_IDLE_MS + " ms");
        }
        if (!Objects.equals(read, settings)) {
            LOG.log(Level.INFO, where + "group settings: " + read);
        }
        settings = read;
        settingsProblem = problem;
    }

    // Reading

    private void readLoop() {
        String cursor = "0"; // own PEL first: entries delivered to this name before a restart
        long groupWait = 0; // not waiting for the group
        while (!stopping) {
            int free = freeSlots();
            if (free == 0) {
                break;
            }
            List<Message> found;
            readSentAt = System.nanoTime();
            try {
                if (cursor != null) {
                    List<StreamMessage<byte[], byte[]>> read = readGroup(XReadArgs.Builder.count(free),
                            StreamOffset.from(streamKey, cursor));
                    cursor = read.isEmpty() ? null : read.get(read.size() - 1).getId();
                    ownPelRead = cursor == null;
                    found = messages(read, partition);
                } else {
                    found = messages(readGroup(XReadArgs.Builder.count(free).block(block),
                            StreamOffset.lastConsumed(streamKey)), partition);
                }
            } catch (RedisCommandExecutionException e) {
                readSentAt = null;
                if (!String.valueOf(e.getMessage()).startsWith("NOGROUP")) {
                    LOG.log(Level.WARNING, where + "read refused; retrying: " + e.getMessage());
                    pause(500);
                    continue;
                }
                // The group is the operator's to create: wait for it, say so once.
                if (groupWait == 0) {
                    LOG.log(Level.WARNING, where + "group " + group + " does not exist on stream " + stream
                            + " yet: waiting for the operator to create it");
                    groupWait = 1000;
                }
                pause(groupWait);
                groupWait = Math.min(groupWait * 2, 10_000);
                continue;
            } catch (RuntimeException e) {
                readSentAt = null;
                LOG.log(Level.WARNING, where + "read failed; retrying: " + e);
                pause(500);
                continue;
            }
            if (groupWait != 0) {
                LOG.log(Level.INFO, where + "group " + group + " exists now: reading");
                groupWait = 0;
            }
            if (stopping) {
                // The read was sent before the stop, and the server delivered to this consumer all the same.
                unhandled = found.stream().map(Message::id).toList();
                break;
            }
            for (Message message : found) {
                start(message);
            }
            readSentAt = null;
            if (!found.isEmpty() && drainers.get() == 0) {
                startDrainers(1);
            }
        }
    }

    /**
     * Waits until every message read has started and a slot is free; answers how many are free, 0 once the worker
     * stops. Meanwhile it watches the queue: messages that waited {@link #QUEUE_WAIT_NANOS} behind a busy thread get
     * threads of their own.
     */
    private int freeSlots() {
        while (true) {
            synchronized (slots) {
                try {
                    Queued head = queued.peek();
                    if (stopping) {
                        return 0;
                    }
                    if (head == null) {
                        if (running < concurrency) {
                            return concurrency - running;
                        }
                        slots.wait();
                        continue;
                    }
                    long waited = System.nanoTime() - head.at;
                    if (waited < QUEUE_WAIT_NANOS) {
                        TimeUnit.NANOSECONDS.timedWait(slots, QUEUE_WAIT_NANOS - waited);
                        continue;
                    }
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                    return 0;
                }
            }
            // Every thread awake is busy with a slow handler: more threads, then a look again after the wait.
            startDrainers(queued.size());
            synchronized (slots) {
                try {
                    TimeUnit.NANOSECONDS.timedWait(slots, QUEUE_WAIT_NANOS);
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                    return 0;
                }
            }
        }
    }

    // Lettuce takes the offsets as generic varargs: javac calls the array it makes for one offset unchecked.
    @SuppressWarnings("unchecked")
    private List<StreamMessage<byte[], byte[]>> readGroup(XReadArgs args, StreamOffset<byte[]> from) {
        return reader.sync.xreadgroup(Consumer.from(groupName, consumerName), args, from);
    }

    /**
     * At a lease tick, once the worker read its own PEL: takes up what {@code strategy: Reassign} handed over, as many
     * as slots are free (the rest at the next tick), and queues them as new messages.
     */
    private void takeUpHandOvers() {
        int free;
        synchronized (slots) {
            free = stopping || !ownPelRead ? 0 : concurrency - running;
        }
        if (free <= 0) {
            return;
        }
        List<Message> found = takeHandedOver(free);
        if (found.isEmpty()) {
            return;
        }
        for (Message message : found) {
            start(message);
        }
        startDrainers(found.size());
    }

    /**
     * Up to {@code count} entries of the own PEL that are neither in flight nor failed here (or failed here and handed
     * back since: idle for less than the time since they failed, less a second) nor delivered once since the read in
     * flight was sent (they may be its own): the ones {@code strategy: Reassign} handed over. Taken with {@code lease.lua} (never a plain XCLAIM, which would take back what the pass meanwhile
     * gave to someone else), then read with {@code XRANGE}.
     */
    private List<Message> takeHandedOver(int count) {
        int asked = count + inFlight.size() + failedHere.size();
        // Taken before the server measures idle times: an entry untouched since it failed here is idle this long.
        long askedAt = System.nanoTime();
        List<PendingMessage> pending = await(writes.xpending(streamKey, Consumer.from(groupName, consumerName),
                Range.unbounded(), Limit.from(asked)));
        // Taken after the reply: an entry delivered by the read in flight is idle at most this long, give or take the
        // server's whole milliseconds (one delivered within a millisecond of the read's sending may be listed idle a
        // millisecond longer), and delivered once. A hand-over raises the count (Reassign's RETRYCOUNT) and is taken
        // at once; one whose count a shutdown's give-back had lowered to 0, like an entry whose read's reply was lost,
        // is taken once it is older than the read in flight.
        Long readAt = readSentAt;
        long sinceReadNanos = readAt == null ? -1 : System.nanoTime() - readAt + 1_000_000;
        if (pending.size() < asked) {
            // The whole own PEL: what failed here and left it (requeued, dead-lettered, handed on) is forgotten.
            Set<String> listed = new HashSet<>();
            pending.forEach(p -> listed.add(p.getId()));
            failedHere.keySet().retainAll(listed);
        }
        List<String> candidates = new ArrayList<>();
        for (PendingMessage p : pending) {
            // Read now, not before the call: one that failed while the XPENDING was out (its outcome written, so no
            // longer in flight) failed after askedAt, and is not handed back.
            Long failedAt = failedHere.get(p.getId());
            boolean handedBack = failedAt == null
                    || p.getMsSinceLastDelivery() + HAND_OVER_MARGIN_MS <= (askedAt - failedAt) / 1_000_000;
            boolean perhapsRead = p.getRedeliveryCount() == 1
                    && p.getMsSinceLastDelivery() * 1_000_000 <= sinceReadNanos;
            if (!inFlight.containsKey(p.getId()) && handedBack && !perhapsRead && candidates.size() < count) {
                candidates.add(p.getId());
            }
        }
        if (candidates.isEmpty()) {
            return List.of();
        }
        List<String> taken = lease(candidates);
        taken.forEach(failedHere::remove);
        List<CompletableFuture<List<StreamMessage<byte[], byte[]>>>> ranges = new ArrayList<>();
        for (String id : taken) {
            ranges.add(writes.xrange(streamKey, Range.create(id, id)).toCompletableFuture());
        }
        List<StreamMessage<byte[], byte[]>> entries = new ArrayList<>();
        for (CompletableFuture<List<StreamMessage<byte[], byte[]>>> range : ranges) {
            entries.addAll(await(range));
        }
        return messages(entries, partition);
    }

    // Dispatch: the only place that acknowledges

    private void start(Message message) {
        InFlight entry = new InFlight(message.id());
        inFlight.put(message.id(), entry);
        meter.started();
        synchronized (slots) {
            running++;
        }
        queued.add(new Queued(message, entry, System.nanoTime()));
    }

    /** Starts up to {@code wanted} more drainers on the executor, never more than {@code concurrency} in all. */
    private void startDrainers(int wanted) {
        for (int i = 0; i < wanted && claimDrainer(); i++) {
            try {
                executor.execute(this::drain);
            } catch (RejectedExecutionException e) {
                drainers.decrementAndGet();
                // An executor of the application's that was shut down: the entries stay pending, retried by the pass.
                LOG.log(Level.WARNING, where + "the handler executor refused to run handlers: " + e);
                for (Queued refused = queued.poll(); refused != null; refused = queued.poll()) {
                    land(refused.message.id());
                    freeSlot();
                }
                return;
            }
        }
    }

    private boolean claimDrainer() {
        for (int n = drainers.get(); n < concurrency; n = drainers.get()) {
            if (drainers.compareAndSet(n, n + 1)) {
                return true;
            }
        }
        return false;
    }

    /** Runs the queued messages' handlers, one after another, until the queue is empty. */
    private void drain() {
        while (true) {
            Queued next = queued.poll();
            if (next != null) {
                handle(next.message, next.entry);
                continue;
            }
            drainers.decrementAndGet();
            // A message queued after the poll, by a reader that saw this drainer still running: take it.
            if (queued.isEmpty() || !claimDrainer()) {
                return;
            }
        }
    }

    private void handle(Message message, InFlight entry) {
        synchronized (entry) {
            if (entry.state.get() == InFlight.ABANDONED) {
                freeSlot(); // given back at the end of the grace before it started
                return;
            }
            if (versionMet != null || aborted) {
                // Never handled under a contract this library does not know (given back by the shutdown), nor on a
                // partition lost.
                freeSlot();
                return;
            }
            if (fresh != null && !fresh.getAsBoolean()) {
                freeSlot();
                // The membership may have expired: the partition may be another's. The topic worker starts it again
                // once a heartbeat answers.
                LOG.log(Level.WARNING, where + "no membership heartbeat answered within the ttl: the partition is stopped");
                abort();
                return;
            }
            entry.thread = Thread.currentThread();
        }
        Tracing.Processing run = Tracing.CURRENT.processing(tracedAs, message);
        long began = System.nanoTime();
        Outcome outcome;
        try {
            outcome = handler.handle(message);
        } catch (Throwable e) {
            // An Error as well (StackOverflowError, NoClassDefFoundError, AssertionError): a failure of the message,
            // never of the worker, whose thread goes on with the next one.
            run.end(null, e);
            settle(message, entry, null, e, System.nanoTime() - began);
            return;
        }
        long ran = System.nanoTime() - began;
        Throwable failure = outcome == null ? new IllegalStateException("the handler returned null, not an Outcome") : null;
        run.end(outcome, failure);
        settle(message, entry, outcome, failure, ran);
    }

    /**
     * The handler ended (after {@code ran} nanoseconds): frees its slot and writes its outcome, unless the grace's end
     * gave the entry back.
     */
    private void settle(Message message, InFlight entry, Outcome outcome, Throwable failure, long ran) {
        synchronized (entry) {
            entry.thread = null;
        }
        boolean mine = entry.state.compareAndSet(InFlight.RUNNING, InFlight.SETTLED);
        if (!mine) {
            Thread.interrupted(); // the interrupt of the grace's end was for this handler, not the next task
        }
        freeSlot();
        if (mine && aborted) {
            land(message.id()); // lost: another's now, no outcome written
            entry.written.complete(null);
        } else if (mine) {
            CompletableFuture<Void> write =
                    failure != null ? fail(message.id(), failure, ran) : write(message, outcome, ran);
            write.whenComplete((ignored, error) -> {
                land(message.id());
                entry.written.complete(null);
            });
        }
    }

    private void freeSlot() {
        synchronized (slots) {
            running--;
            // The reader reads once every message read has started: while some wait, its watch wakes it.
            if (queued.isEmpty()) {
                slots.notifyAll();
            }
        }
    }

    private CompletableFuture<Void> write(Message message, Outcome outcome, long ran) {
        return switch (outcome.kind()) {
            case DONE -> ack(message, ran);
            case TERMINAL -> ackTerminal(message.id(), outcome.reason(), ran);
            case RETRY -> giveBackForRetry(message.id(), ran);
        };
    }

    /** Takes {@code id} out of flight. */
    private void land(String id) {
        if (inFlight.remove(id) != null) {
            meter.landed();
        }
    }

    /** Counts a handler run that took {@code ran} nanoseconds as {@code ended}, in the stats and their metrics. */
    private void count(Metering.Ended ended, long ran, Throwable handlerError) {
        LongAdder counter = switch (ended) {
            case DONE -> done;
            case TERMINAL -> terminal;
            case FAILED -> failed;
            case RETRIED -> retried;
        };
        counter.increment();
        meter.ended(ended, ran, handlerError);
    }

    private CompletableFuture<Void> ack(Message message, long ran) {
        String id = message.id();
        // A message that failed before (here, or elsewhere before it was requeued) may have a last error to remove.
        boolean clearError = errorsRecorded.remove(id) | message.bytes(Keys.DELIVERIES_FIELD) != null;
        return acks.add(id, clearError).handle((ignored, error) -> {
            if (error == null) {
                count(Metering.Ended.DONE, ran, null);
            } else {
                writeFailed("XACK", id, error, ran);
            }
            return null;
        });
    }

    private CompletableFuture<Void> ackTerminal(String id, String reason, long ran) {
        LOG.log(Level.WARNING, where + "message ended as terminal, will ACK: stream=" + stream + " group=" + group
                + " entry_id=" + id + " reason=" + reason);
        errorsRecorded.remove(id);
        byte[][] keys = {streamKey, terminalKey, errorsKey};
        return Script.TERMINAL_ACK.<Long>run(writes, ScriptOutputType.INTEGER, keys, groupName, bytes(id), bytes(reason))
                .handle((ignored, error) -> {
                    if (error == null) {
                        count(Metering.Ended.TERMINAL, ran, null);
                    } else {
                        writeFailed("terminal ACK", id, error, ran);
                    }
                    return null;
                });
    }

    /** {@code give_back.lua} with {@code minIdleMs}, the delivery counted: the pass retries it under the backoff. */
    private CompletableFuture<Void> giveBackForRetry(String id, long ran) {
        // Not read again here: the give-back makes it look idle, not handed over. It looks untouched since idle ago: a
        // hand-over back to this worker (the only live one) may come within a second, and is told by its idle all the same.
        Settings current = settings;
        long idle = current != null ? current.minIdleMs() : Settings.UNPUBLISHED_IDLE_MS;
        leasing.acquireUninterruptibly();
        CompletableFuture<Long> given;
        try {
            failedHere.put(id, System.nanoTime() - idle * 1_000_000);
            given = giveBack(List.of(id), idle, false);
        } catch (RuntimeException e) {
            given = CompletableFuture.failedFuture(e);
        }
        return given.whenComplete((ignored, error) -> leasing.release()).handle((ignored, error) -> {
            if (error != null) {
                LOG.log(Level.WARNING, where + "could not give " + id + " back for a retry: it is retried after minIdle: "
                        + Script.cause(error));
                // Not given back: untouched since it failed here, never since idle ago.
                failedHere.put(id, System.nanoTime());
            }
            count(Metering.Ended.RETRIED, ran, null);
            return null;
        });
    }

    private CompletableFuture<Void> fail(String id, Throwable error, long ran) {
        String text = errorText(error);
        // One line per failure, never a stack trace: a store outage fails every message, and the logs stay readable.
        LOG.log(Level.WARNING, where + "handler failed on " + id + " (" + text + "); the message stays pending for the "
                + "operator's retry");
        failedHere.put(id, System.nanoTime());
        count(Metering.Ended.FAILED, ran, error);
        return writes.hset(errorsKey, bytes(id), bytes(text)).toCompletableFuture().handle((ignored, failure) -> {
            if (failure != null) {
                LOG.log(Level.WARNING, where + "could not record the last error of " + id + ": " + Script.cause(failure));
                return null;
            }
            // A requeued message comes back under a new id, so an old id may never be ACKed here: bounded.
            if (errorsRecorded.size() >= ERRORS_REMEMBERED) {
                errorsRecorded.clear();
            }
            errorsRecorded.add(id);
            return null;
        });
    }

    private void writeFailed(String what, String id, Throwable error, long ran) {
        Throwable cause = Script.cause(error);
        // A server's error reply means nothing was written (the scripts check everything before their first write);
        // a broken connection leaves it open.
        String message = cause instanceof RedisCommandExecutionException
                ? what + " of " + id + " refused; the message stays pending: "
                : what + " of " + id + ": outcome unknown (the connection failed), it may be written or the message "
                        + "stays pending: ";
        LOG.log(Level.WARNING, where + message + cause);
        // Left pending for the pass: this worker takes it up again only once it is handed back.
        failedHere.put(id, System.nanoTime());
        count(Metering.Ended.FAILED, ran, null);
    }

    // Leases

    private void scheduleLease() {
        try {
            leaser.schedule(this::leaseTick, Settings.leaseInterval(settings).toMillis(), TimeUnit.MILLISECONDS);
        } catch (RejectedExecutionException e) {
            // closed: no more ticks
        }
    }

    /**
     * One tick: re-read the settings (a lowered {@code minIdle} is leased at its new pace before it counts), then
     * extend every entry whose handler runs for less than {@code maxHandling} (one handled longer is no longer
     * extended, said once) with {@code lease.lua}, which is also the worker's heartbeat (run with no ids as well), then
     * take up what was handed over.
     */
    private void leaseTick() {
        try {
            try {
                refreshSettings(false);
            } catch (RuntimeException e) {
                if (!leaser.isShutdown()) {
                    LOG.log(Level.WARNING, where + "could not re-read the group's settings; the last ones stay: " + e);
                }
            }
            // A retry waits for the tick's end (see leasing).
            leasing.acquireUninterruptibly();
            try {
                leaseAndTakeUp();
            } finally {
                leasing.release();
            }
        } finally {
            scheduleLease();
        }
    }

    /** The lease of what runs, then the take-up of hand-overs; called with {@link #leasing} held. */
    private void leaseAndTakeUp() {
        // Before the ids are gathered: a handler that fails (on its own thread) after its id was taken for this lease
        // fails after sent, and the lease, which may reach the server after the failure, is accounted for.
        long sent = System.nanoTime();
        Map<String, Long> running = new HashMap<>();
        for (InFlight entry : inFlight.values()) {
            // A settled entry's outcome is being written: a lease after its give-back would undo the idle it set.
            if (entry.state.get() == InFlight.RUNNING) {
                running.put(entry.id, entry.startedAt);
            }
        }
        List<String> ids = maxHandling.leased(running, System.nanoTime());
        List<String> kept;
        try {
            kept = lease(ids);
        } catch (RuntimeException e) {
            if (!leaser.isShutdown()) {
                LOG.log(Level.WARNING, where + "could not extend the leases; retrying: " + e);
            }
            return;
        } finally {
            failedAtReply(ids, sent, System.nanoTime());
        }
        warnLost(ids, kept);
        try {
            takeUpHandOvers();
        } catch (RuntimeException e) {
            if (!leaser.isShutdown()) {
                LOG.log(Level.WARNING, where + "could not take up hand-overs; looking again at the next tick: " + e);
            }
        }
    }

    /**
     * A handler that failed while the lease of {@code ids} was on its way (a paused server answers late): the lease may
     * have reset the entry's idle time after the failure, so the entry looks untouched since {@code answered}, not
     * since it failed; else the own-PEL check would take it for a hand-over and run it again here. Every id here was
     * running when the lease gathered it (after {@code sent}). No retry is marked meanwhile: it waits for
     * {@link #leasing}.
     */
    private void failedAtReply(List<String> ids, long sent, long answered) {
        for (String id : ids) {
            failedHere.computeIfPresent(id, (key, at) -> at - sent >= 0 ? answered : at);
        }
    }

    /** Says once of each id leased and not kept that the pass took it while its handler runs. */
    private void warnLost(List<String> ids, List<String> kept) {
        Set<String> extended = new HashSet<>(kept);
        for (String id : ids) {
            InFlight entry = inFlight.get(id);
            if (!extended.contains(id) && entry != null && entry.state.get() == InFlight.RUNNING && !entry.lost) {
                entry.lost = true;
                LOG.log(Level.WARNING, where + id + " is no longer this consumer's (the operator's pass took it) "
                        + "while its handler runs: it may be handled twice");
            }
        }
    }

    /**
     * Extends (or takes up) {@code ids} and writes the heartbeat (so it runs once with no ids); answers the ids still
     * this consumer's.
     */
    private List<String> lease(List<String> ids) {
        List<String> kept = new ArrayList<>();
        for (int from = 0; from < Math.max(ids.size(), 1); from += ID_BATCH) {
            List<String> batch = ids.subList(Math.min(from, ids.size()), Math.min(ids.size(), from + ID_BATCH));
            byte[][] args = new byte[2 + batch.size()][];
            args[0] = groupName;
            args[1] = consumerName;
            for (int i = 0; i < batch.size(); i++) {
                args[2 + i] = bytes(batch.get(i));
            }
            List<?> reply = await(Script.LEASE.<List<?>>run(writes, ScriptOutputType.MULTI,
                    new byte[][] {streamKey, consumersKey}, args));
            for (Object id : reply) {
                kept.add(new String((byte[]) id, StandardCharsets.UTF_8));
            }
        }
        return kept;
    }

    /**
     * {@code give_back.lua} for {@code ids} in batches: with {@code uncount} the worker is leaving, and it is called
     * once even without ids, so that its consumer is deleted once it owns nothing. Answers how many were given back.
     */
    private CompletableFuture<Long> giveBack(List<String> ids, long idleMs, boolean uncount) {
        CompletableFuture<Long> total = CompletableFuture.completedFuture(0L);
        for (int from = 0; from < Math.max(ids.size(), 1); from += ID_BATCH) {
            List<String> batch = ids.subList(Math.min(from, ids.size()), Math.min(ids.size(), from + ID_BATCH));
            byte[][] args = new byte[4 + batch.size()][];
            args[0] = groupName;
            args[1] = consumerName;
            args[2] = bytes(Long.toString(idleMs));
            args[3] = bytes(uncount ? "1" : "0");
            for (int i = 0; i < batch.size(); i++) {
                args[4 + i] = bytes(batch.get(i));
            }
            CompletableFuture<Long> given =
                    Script.GIVE_BACK.run(writes, ScriptOutputType.INTEGER, new byte[][] {streamKey}, args);
            total = total.thenCombine(given, Long::sum);
        }
        return total;
    }

    // Shutdown

    private void shutDown() {
        stopping = true;
        stopSignal.countDown();
        synchronized (slots) {
            slots.notifyAll();
        }
        if (aborted) {
            abandonAll();
            return;
        }
        try {
            // The read in flight is awaited: the server delivers to this consumer whatever becomes of the call.
            readerThread.join(block.plus(READ_MARGIN).toMillis());
            if (readerThread.isAlive()) {
                LOG.log(Level.WARNING, where + "the read in flight did not return; what it brings waits for minIdle");
            }
            // The reader watched the queue: now every message read and not started gets a thread if one is free.
            startDrainers(queued.size());
            long deadline = System.nanoTime() + shutdownGrace.toNanos();
            synchronized (slots) {
                for (long left = shutdownGrace.toNanos(); running > 0 && left > 0; left = deadline - System.nanoTime()) {
                    TimeUnit.NANOSECONDS.timedWait(slots, left);
                }
            }
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt(); // gives back at once
        }
        List<String> left = new ArrayList<>(unhandled);
        List<InFlight> writing = new ArrayList<>();
        for (InFlight entry : inFlight.values()) {
            if (entry.state.compareAndSet(InFlight.RUNNING, InFlight.ABANDONED)) {
                // No longer this worker's, though its handler may still run: neither leased nor counted in flight.
                land(entry.id);
                left.add(entry.id);
                synchronized (entry) {
                    if (entry.thread != null) {
                        entry.thread.interrupt();
                    }
                }
            } else {
                writing.add(entry);
            }
        }
        // Outcomes being written finish first, so the consumer owns nothing they would still remove.
        for (InFlight entry : writing) {
            try {
                await(entry.written);
            } catch (RuntimeException e) {
                LOG.log(Level.WARNING, where + "the outcome of " + entry.id + " was not written in time: " + e);
            }
        }
        giveBackOnShutdown(left);
    }

    /**
     * {@code give_back.lua} with {@code retryAfterMs} and ARGV[4] = 1: each entry uncounted and left without an owner,
     * taken by the next pass whatever its idle time; the consumer deleted once it owns nothing (called with no ids when
     * nothing is left), so {@code strategy: Reassign} never hands work to a worker that left.
     */
    private void giveBackOnShutdown(List<String> left) {
        Settings current = settings;
        long idle = current != null ? current.retryAfterMs() : Settings.UNPUBLISHED_IDLE_MS;
        try {
            long given = await(giveBack(left, idle, true));
            // Only what the give-back released: an entry the pass took meanwhile is not this worker's to count.
            abandoned.add(given);
            meter.abandoned(given);
            LOG.log(Level.INFO, where + "shutdown: " + given + " messages given back for the next pass (not finished "
                    + "within the grace, or read unhandled), their delivery not counted");
        } catch (RuntimeException e) {
            LOG.log(Level.WARNING, where + "could not give back " + left.size() + " messages on shutdown (nor leave the "
                    + "group): they are retried after minIdle: " + e);
        }
    }

    /**
     * A lost partition's shutdown: its entries are another's now. Handlers still running are interrupted, and nothing
     * is leased, written or given back (the new owner takes the pending list over).
     */
    private void abandonAll() {
        leaser.shutdownNow();
        for (InFlight entry : inFlight.values()) {
            if (entry.state.compareAndSet(InFlight.RUNNING, InFlight.ABANDONED)) {
                land(entry.id);
                synchronized (entry) {
                    if (entry.thread != null) {
                        entry.thread.interrupt();
                    }
                }
            }
        }
        LOG.log(Level.WARNING, where + "partition lost: stopped at once, its messages left to the new owner");
    }

    /**
     * Stops a topic's lost partition at once, on a thread of its own (this call returns at once): no handler starts,
     * no outcome is written, nothing is given back. {@link #whenClosed()} completes once it stopped.
     */
    void abort() {
        aborted = true;
        threads("pelican-abort-" + consumer, true).newThread(this::close).start();
    }

    /** Completes once the worker is closed: by {@link #close()}, an {@link #abort()}, or an unknown contract met. */
    CompletableFuture<Void> whenClosed() {
        return closed.copy();
    }

    /** The unknown contract version a lease tick met, which shut the worker down; {@code null} when none. */
    ContractVersionException versionMet() {
        return versionMet;
    }

    private void release() {
        if (leaser != null) {
            leaser.shutdownNow();
        }
        if (ownExecutor != null) {
            ownExecutor.shutdownNow();
        }
        if (reader != null) {
            reader.close();
        }
        if (writer != null) {
            writer.close();
        }
        if (ownClient != null) {
            ownClient.shutdown();
        }
    }

    // Helpers

    /** Sleeps, or less when the worker stops. */
    private void pause(long millis) {
        try {
            stopSignal.await(millis, TimeUnit.MILLISECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }

    private <T> T await(CompletionStage<T> call) {
        return Script.await(call, writer.timeout());
    }

    static List<Message> messages(List<StreamMessage<byte[], byte[]>> entries, OptionalInt partition) {
        List<Message> messages = new ArrayList<>(entries.size());
        for (StreamMessage<byte[], byte[]> entry : entries) {
            Map<byte[], byte[]> body = entry.getBody();
            // An entry without fields (its payload was deleted) is not a message: the pass drops it.
            if (body == null || body.isEmpty()) {
                continue;
            }
            // byte[] keys are never equal to each other: Lettuce's map of them keeps every field, repeated names too.
            List<Message.Field> fields = new ArrayList<>(body.size());
            body.forEach((name, value) -> fields.add(new Message.Field(
                    new String(name, StandardCharsets.UTF_8), value != null ? value : new byte[0])));
            messages.add(new Message(entry.getId(), fields, partition));
        }
        return messages;
    }

    /**
     * The text recorded as a message's last error: the exception's simple class name and message, cut to 1,024 bytes
     * of UTF-8 at a character boundary.
     */
    static String errorText(Throwable error) {
        String type = error.getClass().getSimpleName().isEmpty() ? error.getClass().getName()
                : error.getClass().getSimpleName();
        String message = error.getMessage();
        return cutUtf8(message == null || message.isEmpty() ? type : type + ": " + message, Keys.ERROR_TEXT_MAX);
    }

    /** {@code text} cut to at most {@code max} UTF-8 bytes, at a character boundary. */
    static String cutUtf8(String text, int max) {
        byte[] encoded = text.getBytes(StandardCharsets.UTF_8);
        if (encoded.length <= max) {
            return text;
        }
        int end = max;
        // A continuation byte (10xxxxxx) is inside a character: step back to the character's first byte.
        while (end > 0 && (encoded[end] & 0xC0) == 0x80) {
            end--;
        }
        return new String(encoded, 0, end, StandardCharsets.UTF_8);
    }

    static byte[] bytes(String text) {
        return text.getBytes(StandardCharsets.UTF_8);
    }

    private static ThreadFactory threads(String name, boolean daemon) {
        AtomicInteger count = new AtomicInteger();
        return runnable -> {
            Thread thread = new Thread(runnable, name.endsWith("-") ? name + count.incrementAndGet() : name);
            thread.setDaemon(daemon);
            return thread;
        };
    }

    /** A message read and not started yet; {@code at}: when it was queued (nanoTime). */
    private record Queued(Message message, InFlight entry, long at) {}

    /** An entry being handled (or queued to be), or whose outcome is being written. */
    private static final class InFlight {
        /** Queued or in its handler. */
        static final int RUNNING = 0;
        /** The handler returned: its outcome is being written. */
        static final int SETTLED = 1;
        /** Given back at the end of the grace: its outcome is not written. */
        static final int ABANDONED = 2;

        final String id;
        final long startedAt = System.nanoTime();
        final AtomicInteger state = new AtomicInteger(RUNNING);
        /** Completed once the outcome is written (or failed to be). */
        final CompletableFuture<Void> written = new CompletableFuture<>();
        /** The handler's thread while it runs (guarded by this entry): interrupted at the end of the grace. */
        Thread thread;
        /** Taken by the pass while running, said (the lease thread's alone). */
        boolean lost;

        InFlight(String id) {
            this.id = id;
        }
    }

    /**
     * The ACKs, batched: while one {@code XACK} is on its way, the ACKs of the handlers that finish meanwhile queue and
     * go together in the next (one {@code XACK} of many ids, with one {@code HDEL} of the last errors to remove).
     */
    private final class Acks {
        private final ConcurrentLinkedQueue<Ack> queue = new ConcurrentLinkedQueue<>();
        private final AtomicBoolean flushing = new AtomicBoolean();

        CompletableFuture<Void> add(String id, boolean clearError) {
            Ack ack = new Ack(id, clearError);
            queue.add(ack);
            flush();
            return ack.done;
        }

        private void flush() {
            while (!queue.isEmpty() && flushing.compareAndSet(false, true)) {
                List<Ack> batch = new ArrayList<>();
                for (Ack ack; batch.size() < MAX_ACK_BATCH && (ack = queue.poll()) != null; ) {
                    batch.add(ack);
                }
                if (batch.isEmpty()) {
                    flushing.set(false);
                    continue;
                }
                send(batch).whenComplete((ignored, error) -> {
                    for (Ack ack : batch) {
                        if (error == null) {
                            ack.done.complete(null);
                        } else {
                            ack.done.completeExceptionally(error);
                        }
                    }
                    flushing.set(false);
                    flush();
                });
                return;
            }
        }

        private CompletableFuture<Void> send(List<Ack> batch) {
            if (aborted) {
                return CompletableFuture.failedFuture(new RedisException("the partition was lost: no outcome written"));
            }
            String[] ids = new String[batch.size()];
            List<byte[]> clear = new ArrayList<>();
            for (int i = 0; i < ids.length; i++) {
                ids[i] = batch.get(i).id;
                if (batch.get(i).clearError) {
                    clear.add(bytes(ids[i]));
                }
            }
            CompletableFuture<Long> xack = writes.xack(streamKey, groupName, ids).toCompletableFuture();
            if (clear.isEmpty()) {
                return xack.thenApply(count -> null);
            }
            CompletableFuture<Long> hdel = writes.hdel(errorsKey, clear.toArray(new byte[0][])).toCompletableFuture()
                    .exceptionally(error -> {
                        LOG.log(Level.WARNING, where + "could not remove the last errors of acknowledged messages "
                                + "(the operator's passes remove them): " + Script.cause(error));
                        return 0L;
                    });
            return xack.thenCombine(hdel, (count, removed) -> null);
        }
    }

    private static final class Ack {
        final String id;
        final boolean clearError;
        final CompletableFuture<Void> done = new CompletableFuture<>();

        Ack(String id, boolean clearError) {
            this.id = id;
            this.clearError = clearError;
        }
    }

    /** The options of a {@link Worker}; {@code stream}, {@code group} and {@code handler} are required. */
    public static final class Builder {
        private final AbstractRedisClient client;
        private final RedisURI uri;
        private String stream;
        private String group;
        private String consumer;
        private int concurrency = 16;
        private Duration block = Duration.ofSeconds(1);
        private Duration shutdownGrace = Duration.ofSeconds(20);
        private Duration maxHandling = Duration.ofMinutes(30);
        private Handler handler;
        private Executor executor;
        private OptionalInt partition = OptionalInt.empty();
        private BooleanSupplier fresh;

        private Builder(AbstractRedisClient client, RedisURI uri) {
            this.client = client;
            this.uri = uri;
        }

        public Builder stream(String stream) {
            this.stream = stream;
            return this;
        }

        /** The group: the operator's to create; the worker waits for it and never creates it. */
        public Builder group(String group) {
            this.group = group;
            return this;
        }

        /** Default: the Pod's name ({@link PodName#get()}); {@code spec.consumers.pods} matches by it. */
        public Builder consumer(String consumer) {
            this.consumer = consumer;
            return this;
        }

        /** Handlers running at once. Default 16. */
        public Builder concurrency(int concurrency) {
            this.concurrency = concurrency;
            return this;
        }

        /**
         * How long one read waits for new entries: at least 1 ms and below the client's command timeout (the
         * {@code RedisURI}'s, 60 s by default), checked by {@link #build()} (by {@link Worker#start()} on a client of
         * the application's). Default 1 s.
         */
        public Builder block(Duration block) {
            this.block = block;
            return this;
        }

        /** On shutdown, how long handlers may still run before their messages are given back. Default 20 s. */
        public Builder shutdownGrace(Duration shutdownGrace) {
            this.shutdownGrace = shutdownGrace;
            return this;
        }

        /** How long a message's lease is extended; past it the pass may retry the message. Default 30 minutes. */
        public Builder maxHandling(Duration maxHandling) {
            this.maxHandling = maxHandling;
            return this;
        }

        public Builder handler(Handler handler) {
            this.handler = handler;
            return this;
        }

        /**
         * Where handlers run. Default: a fixed pool of {@code concurrency} daemon threads, shut down by
         * {@link Worker#close()}. On Java 21, {@code Executors.newVirtualThreadPerTaskExecutor()}. The worker never runs
         * more than {@code concurrency} handlers on it, and never shuts down an executor it was given.
         */
        public Builder executor(Executor executor) {
            this.executor = executor;
            return this;
        }

        /** The options of {@code other} but its stream, group, consumer and handler: a topic's for each partition. */
        Builder sameOptionsAs(Builder other) {
            this.concurrency = other.concurrency;
            this.block = other.block;
            this.shutdownGrace = other.shutdownGrace;
            this.maxHandling = other.maxHandling;
            this.executor = other.executor;
            return this;
        }

        /** A topic's partition {@code partition}, whose membership is fresh while {@code fresh} says so. */
        Builder partition(int partition, BooleanSupplier fresh) {
            this.partition = OptionalInt.of(partition);
            this.fresh = fresh;
            return this;
        }

        public Worker build() {
            Objects.requireNonNull(stream, "stream");
            Objects.requireNonNull(group, "group");
            Objects.requireNonNull(handler, "handler");
            if (stream.isEmpty() || group.isEmpty() || (consumer != null && consumer.isEmpty())) {
                throw new IllegalArgumentException("stream, group and consumer must not be empty");
            }
            if (concurrency < 1) {
                throw new IllegalArgumentException("concurrency must be at least 1");
            }
            if (!positive(maxHandling) || shutdownGrace.isNegative()) {
                throw new IllegalArgumentException("maxHandling must be positive, shutdownGrace not negative");
            }
            // BLOCK 0 waits for ever on the server while the client gives up at its timeout: what the server then
            // delivers to a read nobody awaits waits for the operator's pass.
            if (block.toMillis() < 1) {
                throw new IllegalArgumentException("block must be at least 1 ms (BLOCK 0 would wait for ever), got " + block);
            }
            if (uri != null) {
                checkBlock(block, uri.getTimeout());
            }
            return new Worker(this);
        }

        /** {@code block} below the timeout of the client's commands, which the blocking read waits for. */
        static void checkBlock(Duration block, Duration timeout) {
            if (block.compareTo(timeout) >= 0) {
                throw new IllegalArgumentException("block (" + block + ") must be below the client's command timeout ("
                        + timeout + "): the client would give up on a read the server still answers");
            }
        }

        private static boolean positive(Duration duration) {
            return !duration.isNegative() && !duration.isZero();
        }
    }
}
