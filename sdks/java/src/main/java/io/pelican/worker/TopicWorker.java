package io.pelican.worker;

import io.lettuce.core.Consumer;
import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisException;
import io.lettuce.core.RedisURI;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.XAutoClaimArgs;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.async.RedisClusterAsyncCommands;
import io.lettuce.core.models.stream.ClaimedMessages;
import java.lang.System.Logger.Level;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.Set;
import java.util.TreeSet;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.Executor;
import java.util.concurrent.Executors;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;

/**
 * A member of a topic's group (contract/README.md, "Topics (contract version 2)"): it owns the partitions
 * {@code membership.lua} assigns it, heartbeats every third of its membership ttl, and runs a worker on each owned
 * partition, the partition's whole pending list taken over first, then new entries. A partition it must release is
 * finished as on SIGTERM (handlers finish within the grace, the rest is given back) and said released at once; a
 * partition lost (its membership expired and the partition went elsewhere) is stopped at once, no outcome written.
 * On an {@code ordering: PerKey} topic each partition runs in order per key.
 *
 * <pre>{@code
 * TopicWorker worker = TopicWorker.builder(RedisURI.create("redis://localhost:6379"))
 *         .topic("orders").group("billing")
 *         .handler(message -> {
 *             bill(message.key().orElseThrow(), message.partition().getAsInt(), message.text("order"));
 *             return Outcome.done();
 *         })
 *         .build();
 * worker.start();   // refuses a topic it cannot run before it joins: NotATopicException, TopicContractException, ...
 * ...
 * worker.close();   // every partition stops as a Worker does, then the member leaves the group
 * }</pre>
 */
public final class TopicWorker implements AutoCloseable {
    private static final System.Logger LOG = System.getLogger("io.pelican.worker");
    /** How long a membership lives without a heartbeat unless the builder says otherwise. */
    public static final Duration DEFAULT_MEMBERSHIP_TTL = Duration.ofSeconds(10);
    /** The most entries one {@code XAUTOCLAIM} of a take-over moves. */
    private static final int TAKE_OVER_BATCH = 100;

    private enum State {
        NEW,
        RUNNING,
        CLOSING,
        CLOSED
    }

    private final AbstractRedisClient givenClient;
    private final RedisURI uri;
    private final String topic;
    private final String group;
    private final String consumer;
    private final Duration membershipTtl;
    private final Worker.Builder partitionOptions;
    private final int concurrency;
    private final Duration block;
    private final Duration shutdownGrace;
    private final Duration maxHandling;
    private final Handler handler;
    private final Executor executor;
    private final String where;

    private final Object lifecycle = new Object();
    private State state = State.NEW;
    private final CompletableFuture<Void> closed = new CompletableFuture<>();
    private AbstractRedisClient client;
    private RedisClient ownClient;
    private Link connection;
    private RedisClusterAsyncCommands<byte[], byte[]> commands;
    private ScheduledExecutorService membership;

    private volatile int partitions;
    private volatile Ordering ordering;
    private volatile Spacing spacing;
    /** When (nanoTime) the last answered heartbeat was sent; {@code null} before the first. */
    private volatile Long beatAt;
    /** The partition runs not ended yet, and the counts of those that ended (guarded by {@code runs}). */
    private final List<PartitionRun> runs = new ArrayList<>();
    private WorkerStats endedCounts = new WorkerStats(0, 0, 0, 0, 0, 0);
    private volatile Set<Integer> ownedView = Set.of();
    private volatile ContractVersionException versionMet;

    // The membership thread's alone:
    private final Map<Integer, Owned> owned = new HashMap<>();
    private List<Integer> released = new ArrayList<>();
    private ScheduledFuture<?> nextBeat;
    private boolean closing;

    private TopicWorker(Builder b) {
        this.givenClient = b.client;
        this.uri = b.uri;
        this.topic = b.topic;
        this.group = b.group;
        this.consumer = b.consumer != null ? b.consumer : PodName.get();
        this.membershipTtl = b.membershipTtl;
        this.partitionOptions = b.partition;
        this.concurrency = b.concurrency;
        this.block = b.block;
        this.shutdownGrace = b.shutdownGrace;
        this.maxHandling = b.maxHandling;
        this.handler = b.handler;
        this.executor = b.executor;
        this.where = "[topic " + topic + " " + group + " " + consumer + "] ";
    }

    /** A member on a client of the application's (never shut down). */
    public static Builder builder(RedisClient client) {
        return new Builder(Objects.requireNonNull(client, "client"), null);
    }

    /** A member on a Redis Cluster client of the application's (never shut down): the partitions spread over its shards. */
    public static Builder builder(RedisClusterClient client) {
        return new Builder(Objects.requireNonNull(client, "client"), null);
    }

    /** A member with a client of its own, shut down by {@link #close()}. */
    public static Builder builder(RedisURI uri) {
        return new Builder(null, Objects.requireNonNull(uri, "uri"));
    }

    public String topic() {
        return topic;
    }

    public String group() {
        return group;
    }

    /** The member's name: its consumer name on every partition it owns. */
    public String consumer() {
        return consumer;
    }

    /** The topic's N, as its settings say; 0 before {@link #start()}. */
    public int partitions() {
        return partitions;
    }

    /** The topic's ordering, as its settings say; {@code null} before {@link #start()}. */
    public Ordering ordering() {
        return ordering;
    }

    /** The partitions this member runs now. */
    public Set<Integer> owned() {
        return ownedView;
    }

    /** Every partition's counts summed, since the start. */
    public WorkerStats stats() {
        synchronized (runs) {
            WorkerStats total = endedCounts;
            for (PartitionRun run : runs) {
                total = sum(total, run.stats());
            }
            return total;
        }
    }

    private static WorkerStats sum(WorkerStats a, WorkerStats b) {
        return new WorkerStats(a.done() + b.done(), a.terminal() + b.terminal(), a.failed() + b.failed(),
                a.retried() + b.retried(), a.abandoned() + b.abandoned(), a.inFlight() + b.inFlight());
    }

    /**
     * Connects, reads the topic's settings (<code>{T}:pelican:T:&lt;group&gt;:settings</code>, its contract version
     * first), joins the group and starts the partitions it owns; heartbeats go on in the background.
     *
     * @throws NotATopicException when no policy with {@code spec.partitions} describes the topic for the group
     * @throws TopicContractException when the topic's settings say a contract this library does not know for topics
     * @throws SettingsException when they name an ordering this library does not know
     * @throws RedisException when the server cannot be reached, or the join is refused ({@code PELICAN_TOO_MANY_MEMBERS})
     * @throws IllegalStateException when the worker was started or closed before
     */
    public void start() {
        synchronized (lifecycle) {
            if (state != State.NEW) {
                throw new IllegalStateException("a topic worker starts once: build a new one");
            }
            Assignment first;
            try {
                client = givenClient;
                if (client == null) {
                    ownClient = RedisClient.create(uri);
                    client = ownClient;
                }
                connection = Link.connect(client);
                commands = connection.async;
                readSettings();
                long sent = System.nanoTime();
                first = heartbeat(false, List.of(), connection.timeout());
                beatAt = sent;
            } catch (RuntimeException e) {
                state = State.CLOSED;
                release();
                closed.complete(null);
                throw e;
            }
            membership = Executors.newSingleThreadScheduledExecutor(runnable -> {
                Thread thread = new Thread(runnable, "pelican-membership-" + consumer);
                thread.setDaemon(true);
                return thread;
            });
            LOG.log(Level.INFO, where + "joined: " + partitions + " partitions, ordering " + ordering);
            membership.execute(() -> {
                follow(first);
                nextBeat = membership.schedule(this::tick, beatInterval(), TimeUnit.MILLISECONDS);
            });
            state = State.RUNNING;
        }
    }

    /**
     * {@link #start()}, then waits until the worker is closed ({@link #close()} from another thread: a shutdown hook).
     *
     * @throws ContractVersionException once the worker shut down, when a partition's settings changed to a contract
     *     this library does not know while it ran
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
     * Stops every partition as a {@link Worker} stops (handlers finish within {@code shutdownGrace}, the rest is given
     * back), then leaves the group: its partitions are free for the other members at their next heartbeat. Idempotent;
     * a second caller waits for the first.
     */
    @Override
    public void close() {
        synchronized (lifecycle) {
            if (state == State.NEW) {
                state = State.CLOSED;
                closed.complete(null);
            }
            if (state != State.RUNNING) {
                closed.join();
                return;
            }
            state = State.CLOSING;
        }
        try {
            List<PartitionRun> stopping;
            try {
                stopping = membership.submit(() -> {
                    closing = true;
                    if (nextBeat != null) {
                        nextBeat.cancel(false);
                    }
                    List<PartitionRun> all = owned.values().stream().map(o -> o.run).toList();
                    owned.clear();
                    ownedView = Set.of();
                    return all;
                }).get();
            } catch (ExecutionException e) {
                throw new IllegalStateException(e.getCause());
            }
            List<Thread> closers = new ArrayList<>();
            for (PartitionRun run : stopping) {
                closers.add(thread("pelican-stop-" + consumer, false, run::close));
            }
            for (Thread closer : closers) {
                closer.join();
            }
            try {
                heartbeat(true, List.of(), connection.timeout());
                LOG.log(Level.INFO, where + "left the topic's group");
            } catch (RuntimeException e) {
                LOG.log(Level.WARNING, where + "could not leave the group: its partitions move when the membership "
                        + "expires: " + e);
            }
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        } finally {
            release();
            synchronized (lifecycle) {
                state = State.CLOSED;
            }
            closed.complete(null);
        }
    }

    // Settings

    private void readSettings() {
        Map<String, String> fields = Settings.decode(await(commands.hgetall(Worker.bytes(Keys.settings(topic, group)))));
        if (fields.isEmpty()) {
            throw new NotATopicException(topic, group);
        }
        partitions = Partitions.described(topic, group, fields);
        String named = fields.getOrDefault("ordering", "None");
        ordering = switch (named) {
            case "None" -> Ordering.NONE;
            case "PerKey" -> Ordering.PER_KEY;
            default -> throw new SettingsException("topic '" + topic + "' has ordering '" + named + "', which this "
                    + "library does not know (None, PerKey): upgrade the library (io.pelican:pelican-worker)");
        };
        spacing = Spacing.of(fields.get("backoffFactor"), fields.get("backoffMaxMs"));
    }

    // Membership

    /** What a heartbeat answers: the partitions owned with their epochs, and those to release. */
    private record Assignment(Map<Integer, Long> owned, List<Integer> release) {}

    /**
     * {@code membership.lua}: renews the membership, frees what was released, answers the assignment; its reply waited
     * for at most {@code within}.
     */
    private Assignment heartbeat(boolean leaving, List<Integer> releasedSince, Duration within) {
        List<byte[]> args = new ArrayList<>();
        args.add(Worker.bytes(consumer));
        args.add(Worker.bytes(Long.toString(membershipTtl.toMillis())));
        args.add(Worker.bytes(Integer.toString(partitions)));
        args.add(Worker.bytes(leaving ? "1" : "0"));
        releasedSince.forEach(p -> args.add(Worker.bytes(Integer.toString(p))));
        byte[][] keys = {Worker.bytes(Keys.members(topic, group)), Worker.bytes(Keys.owners(topic, group)),
            Worker.bytes(Keys.epochs(topic, group))};
        List<?> reply = Script.await(Script.MEMBERSHIP.<List<?>>run(commands, ScriptOutputType.MULTI, keys,
                args.toArray(new byte[0][])), within);
        Map<Integer, Long> ownedNow = new HashMap<>();
        for (Object pair : (List<?>) reply.get(0)) {
            List<?> p = (List<?>) pair;
            ownedNow.put(((Long) p.get(0)).intValue(), (Long) p.get(1));
        }
        List<Integer> release = new ArrayList<>();
        for (Object p : (List<?>) reply.get(1)) {
            release.add(((Long) p).intValue());
        }
        return new Assignment(ownedNow, release);
    }

    /** Whether the last answered heartbeat was sent less than the ttl ago: the partitions are still this member's. */
    boolean fresh() {
        Long at = beatAt;
        return at != null && System.nanoTime() - at < membershipTtl.toNanos();
    }

    private long beatInterval() {
        return membershipTtl.toMillis() / 3;
    }

    /**
     * How long a heartbeat's reply is awaited: while the membership is fresh, no longer than it lasts, so that a member
     * cut off from the server (its call queued for a reconnect, answered at the client's timeout at best) stops its
     * partitions when the ttl since its last answered heartbeat passes, before another member may take them; else a
     * beat interval.
     */
    private Duration replyWithin(long sent) {
        Long at = beatAt;
        long left = at == null ? 0 : at + membershipTtl.toNanos() - sent;
        Duration within = left > 0 ? Duration.ofNanos(left) : Duration.ofMillis(beatInterval());
        return within.compareTo(connection.timeout()) < 0 ? within : connection.timeout();
    }

    /** One heartbeat, on the membership thread. */
    private void tick() {
        if (closing) {
            return;
        }
        long sent = System.nanoTime();
        try {
            Assignment assignment = heartbeat(false, released, replyWithin(sent));
            released = new ArrayList<>();
            beatAt = sent;
            follow(assignment);
        } catch (RuntimeException e) {
            LOG.log(Level.WARNING, where + "membership heartbeat failed; retrying: " + e);
            if (!fresh() && !owned.isEmpty()) {
                LOG.log(Level.WARNING, where + "no heartbeat answered within the ttl: the partitions may be another's, "
                        + "stopped at once");
                owned.values().forEach(o -> o.run.abort());
                owned.clear();
                ownedView = Set.of();
            }
        }
        nextBeat = membership.schedule(this::tick, beatInterval(), TimeUnit.MILLISECONDS);
    }

    /** A heartbeat at once (a partition was released), in place of the one scheduled. */
    private void beatNow() {
        if (nextBeat != null) {
            nextBeat.cancel(false);
        }
        nextBeat = membership.schedule(this::tick, 0, TimeUnit.MILLISECONDS);
    }

    /**
     * Starts a worker on each partition newly owned (or owned under a new epoch: lost and back), stops the lost ones
     * at once, and the ones to release as on SIGTERM.
     */
    private void follow(Assignment assignment) {
        owned.values().removeIf(o -> {
            Long epoch = assignment.owned.get(o.partition);
            if (epoch != null && epoch == o.epoch) {
                return false;
            }
            LOG.log(Level.WARNING, where + "partition " + o.partition + " lost (the membership expired): stopped at once");
            o.run.abort();
            return true;
        });
        assignment.owned.forEach((partition, epoch) -> {
            if (!owned.containsKey(partition)) {
                take(partition, epoch);
            }
        });
        for (int partition : assignment.release) {
            Owned o = owned.get(partition);
            if (o != null && !o.releasing) {
                LOG.log(Level.INFO, where + "releasing partition " + partition + ": its messages in flight finish first");
                o.releasing = true;
                thread("pelican-release-" + consumer, true, o.run::close);
            }
        }
        ownedView = Set.copyOf(new TreeSet<>(owned.keySet()));
    }

    /** Takes the partition's pending list over, then starts its worker; a failure is retried at the next heartbeat. */
    private void take(int partition, long epoch) {
        String stream = Keys.partitionStream(topic, partition);
        PartitionRun run = ordering == Ordering.PER_KEY
                ? new InOrder(client, stream, group, consumer, partition, concurrency, block, shutdownGrace,
                        maxHandling, handler, executor, spacing, this::fresh)
                : new PlainRun(Worker.on(client).stream(stream).group(group).consumer(consumer).handler(handler)
                        .partition(partition, this::fresh), partitionOptions);
        try {
            takeOver(stream);
            run.start();
        } catch (RuntimeException e) {
            LOG.log(Level.WARNING, where + "could not start partition " + partition + "; trying again at the next "
                    + "heartbeat: " + e);
            return;
        }
        synchronized (runs) {
            runs.add(run);
        }
        Owned o = new Owned(partition, epoch, run);
        owned.put(partition, o);
        LOG.log(Level.INFO, where + "partition " + partition + " taken (epoch " + epoch + ")");
        run.whenClosed().thenRun(() -> {
            synchronized (runs) {
                runs.remove(run);
                endedCounts = sum(endedCounts, run.stats());
            }
            try {
                membership.execute(() -> ended(o));
            } catch (RejectedExecutionException e) {
                // closed: nothing more to follow
            }
        });
    }

    /** A partition's worker stopped: released (said at once), lost, or stopped by itself (started again later). */
    private void ended(Owned o) {
        if (owned.get(o.partition) != o) {
            return; // lost, and aborted; or the member is closing
        }
        owned.remove(o.partition);
        ownedView = Set.copyOf(new TreeSet<>(owned.keySet()));
        ContractVersionException met = o.run.versionMet();
        if (met != null && versionMet == null) {
            versionMet = met;
            thread("pelican-shutdown-" + consumer, false, this::close);
            return;
        }
        if (o.releasing) {
            released.add(o.partition);
            beatNow();
        }
    }

    /**
     * Moves the partition's whole pending list to this member ({@code XAUTOCLAIM ... 0 ... JUSTID}, a page at a time
     * from the cursor it answers): the previous owner's entries, this member's own from before, those given back
     * without an owner. The worker's first read of its own pending list then hands them out in id order, each
     * counted as one delivery there ({@code JUSTID} counts none).
     */
    private void takeOver(String stream) {
        String cursor = "0-0";
        do {
            // Within the membership, as a heartbeat: the membership thread stops the partitions when it ends.
            ClaimedMessages<byte[], byte[]> page = Script.await(commands.xautoclaim(Worker.bytes(stream),
                    XAutoClaimArgs.Builder.<byte[]>justid(Consumer.from(Worker.bytes(group), Worker.bytes(consumer)), 0,
                            cursor).count(TAKE_OVER_BATCH)), replyWithin(System.nanoTime()));
            cursor = page.getId();
        } while (cursor != null && !cursor.equals("0-0"));
    }

    /** A thread started on {@code task}. */
    private static Thread thread(String name, boolean daemon, Runnable task) {
        Thread thread = new Thread(task, name);
        thread.setDaemon(daemon);
        thread.start();
        return thread;
    }

    private void release() {
        if (membership != null) {
            membership.shutdownNow();
        }
        if (connection != null) {
            connection.close();
        }
        if (ownClient != null) {
            ownClient.shutdown();
        }
    }

    private <T> T await(CompletionStage<T> call) {
        return Script.await(call, connection.timeout());
    }

    /** An owned partition and its worker; {@code releasing}: told to release it, finishing. */
    private static final class Owned {
        final int partition;
        final long epoch;
        final PartitionRun run;
        boolean releasing;

        Owned(int partition, long epoch, PartitionRun run) {
            this.partition = partition;
            this.epoch = epoch;
            this.run = run;
        }
    }

    /** A plain {@link Worker} on a partition of an {@code ordering: None} topic. */
    private static final class PlainRun implements PartitionRun {
        private final Worker worker;

        PlainRun(Worker.Builder builder, Worker.Builder options) {
            this.worker = builder.sameOptionsAs(options).build();
        }

        @Override
        public void start() {
            worker.start();
        }

        @Override
        public void close() {
            worker.close();
        }

        @Override
        public void abort() {
            worker.abort();
        }

        @Override
        public CompletableFuture<Void> whenClosed() {
            return worker.whenClosed();
        }

        @Override
        public WorkerStats stats() {
            return worker.stats();
        }

        @Override
        public ContractVersionException versionMet() {
            return worker.versionMet();
        }
    }

    /**
     * How PerKey retries are spaced in place: {@code minIdleMs * factor^(n-1)}, at most {@code maxMs} (0: no most).
     *
     * @param factor the settings' {@code backoffFactor}, at least 1
     * @param maxMs the settings' {@code backoffMaxMs}
     */
    record Spacing(double factor, long maxMs) {
        static Spacing of(String factor, String maxMs) {
            double f = 1;
            long max = 0;
            try {
                f = factor == null ? 1 : Math.max(1, Double.parseDouble(factor));
                max = maxMs == null ? 0 : Math.max(0, Long.parseLong(maxMs));
            } catch (NumberFormatException e) {
                // a malformed field: no backoff beyond minIdle
            }
            return new Spacing(f, max);
        }

        /** The wait before run {@code deliveries + 1} of an entry that ran {@code deliveries} times. */
        long afterMs(long minIdleMs, long deliveries) {
            double wait = minIdleMs * Math.pow(factor, Math.max(deliveries - 1, 0));
            long ms = (long) Math.min(wait, 86_400_000d); // no overflow
            return maxMs > 0 ? Math.min(ms, maxMs) : ms;
        }
    }

    /**
     * The options of a {@link TopicWorker}; {@code topic}, {@code group} and {@code handler} are required. The rest
     * are a {@link Worker}'s, for each partition it runs ({@code concurrency}: each partition's).
     */
    public static final class Builder {
        private final AbstractRedisClient client;
        private final RedisURI uri;
        private String topic;
        private String group;
        private String consumer;
        private Duration membershipTtl = DEFAULT_MEMBERSHIP_TTL;
        private int concurrency = 16;
        private Duration block = Duration.ofSeconds(1);
        private Duration shutdownGrace = Duration.ofSeconds(20);
        private Duration maxHandling = Duration.ofMinutes(30);
        private Handler handler;
        private Executor executor;
        private Worker.Builder partition;

        private Builder(AbstractRedisClient client, RedisURI uri) {
            this.client = client;
            this.uri = uri;
        }

        /** The topic: the policy's {@code spec.stream}. */
        public Builder topic(String topic) {
            this.topic = topic;
            return this;
        }

        public Builder group(String group) {
            this.group = group;
            return this;
        }

        /** The member's name, its consumer on every partition. Default: the Pod's name ({@link PodName#get()}). */
        public Builder consumer(String consumer) {
            this.consumer = consumer;
            return this;
        }

        /**
         * How long the membership lives without a heartbeat: 1 s .. 24 h, default 10 s; a heartbeat every third of
         * it. A member whose heartbeats go unanswered that long stops every partition it had. Keep it well above the
         * pauses the application can have (a long garbage collection, a stopped process).
         */
        public Builder membershipTtl(Duration membershipTtl) {
            this.membershipTtl = membershipTtl;
            return this;
        }

        /** Handlers running at once on each partition. Default 16. */
        public Builder concurrency(int concurrency) {
            this.concurrency = concurrency;
            return this;
        }

        /** As {@link Worker.Builder#block}. */
        public Builder block(Duration block) {
            this.block = block;
            return this;
        }

        /** As {@link Worker.Builder#shutdownGrace}: also how long a released partition's handlers may finish. */
        public Builder shutdownGrace(Duration shutdownGrace) {
            this.shutdownGrace = shutdownGrace;
            return this;
        }

        /** As {@link Worker.Builder#maxHandling}. */
        public Builder maxHandling(Duration maxHandling) {
            this.maxHandling = maxHandling;
            return this;
        }

        /** The handler: {@link Message#partition()} and {@link Message#key()} say where a message is from. */
        public Builder handler(Handler handler) {
            this.handler = handler;
            return this;
        }

        /** As {@link Worker.Builder#executor}: shared by every partition. */
        public Builder executor(Executor executor) {
            this.executor = executor;
            return this;
        }

        /**
         * @throws IllegalArgumentException for a membership ttl out of 1 s .. 24 h, a topic name with braces, or a
         *     {@link Worker}'s options it refuses
         */
        public TopicWorker build() {
            Objects.requireNonNull(topic, "topic");
            Objects.requireNonNull(membershipTtl, "membershipTtl");
            if (topic.contains("{") || topic.contains("}")) {
                throw new IllegalArgumentException("a topic's name holds no { or }, got '" + topic + "'");
            }
            if (membershipTtl.compareTo(Duration.ofSeconds(1)) < 0 || membershipTtl.compareTo(Duration.ofHours(24)) > 0) {
                throw new IllegalArgumentException("the membership ttl must be 1 s .. 24 h, got " + membershipTtl);
            }
            // Every partition's options, checked once here.
            partition = (client != null ? Worker.on(client) : Worker.builder(uri)).stream(topic).group(group)
                    .consumer(consumer).handler(handler).concurrency(concurrency).block(block)
                    .shutdownGrace(shutdownGrace).maxHandling(maxHandling).executor(executor);
            partition.build();
            return new TopicWorker(this);
        }
    }
}
