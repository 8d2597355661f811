package io.pelican.worker;

import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.ClientOptions;
import io.lettuce.core.ClientOptions.DisconnectedBehavior;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisCommandExecutionException;
import io.lettuce.core.RedisConnectionException;
import io.lettuce.core.RedisException;
import io.lettuce.core.RedisURI;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.TimeoutOptions;
import io.lettuce.core.cluster.ClusterClientOptions;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.codec.ByteArrayCodec;
import io.lettuce.core.output.NestedMultiOutput;
import io.lettuce.core.protocol.CommandArgs;
import io.lettuce.core.protocol.CommandType;
import io.lettuce.core.resource.ClientResources;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.Optional;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * Publishes into a stream through the contract's bounded publish scripts, and tells the outcomes apart by the
 * {@link PublishException} it throws.
 *
 * <p>Its connection never sends a publish twice. Lettuce's defaults would: with {@code autoReconnect} a command whose
 * reply was lost with the connection is queued again and sent after the reconnect, which writes the message twice.
 * The producer's own client has {@code DisconnectedBehavior.REJECT_COMMANDS}: a publish in flight when the connection
 * drops fails (outcome unknown) instead of being resent, and one made while it is down fails at once, never sent
 * (unavailable). It still reconnects by itself for the next publish.
 *
 * <pre>{@code
 * try (Producer producer = Producer.builder(RedisURI.create("redis://localhost:6379")).stream("files").build()) {
 *     String id = producer.publish(Map.of("job", "42"));
 * } catch (PublishRefusedException refused) {
 *     // a bounded group's backlog is full: nothing written, publish again later with backoff and jitter
 * }
 * }</pre>
 */
public final class Producer implements AutoCloseable {
    /** Server errors after which nothing was written and publishing again may succeed. */
    private static final Set<String> UNAVAILABLE = Set.of("READONLY", "LOADING", "MASTERDOWN", "BUSY", "TRYAGAIN");
    /** {@code PELICAN_BACKLOG_FULL <group> <backlog> <max>}; the group's name may hold spaces. */
    private static final Pattern BACKLOG_FULL = Pattern.compile("PELICAN_BACKLOG_FULL (.*) (\\d+) (\\d+)", Pattern.DOTALL);
    /** Lettuce's words for a command it never sent: the connection was down and commands are rejected meanwhile. */
    private static final String NOT_SENT = "Currently not connected";

    private final String stream;
    /** This producer's publishes through OpenTelemetry's metrics API. */
    private final Metering.ProducerMeter meter;
    private final Duration timeout;
    private final AbstractRedisClient client;
    private final byte[][] keys;
    /** Whose connection this producer publishes on: itself, or the producer it was made beside (a topic's). */
    private final Producer root;
    private Link connection;

    private Producer(Builder b) {
        this.stream = b.stream;
        this.meter = Metering.CURRENT.producer(b.stream);
        this.timeout = b.timeout;
        if (b.cluster) {
            RedisClusterClient cluster = b.resources != null ? RedisClusterClient.create(b.resources, b.uri)
                    : RedisClusterClient.create(b.uri);
            cluster.setOptions(ClusterClientOptions.builder()
                    .disconnectedBehavior(DisconnectedBehavior.REJECT_COMMANDS)
                    .timeoutOptions(TimeoutOptions.enabled(b.timeout))
                    .build());
            this.client = cluster;
        } else {
            RedisClient single = b.resources != null ? RedisClient.create(b.resources, b.uri) : RedisClient.create(b.uri);
            single.setOptions(ClientOptions.builder()
                    .disconnectedBehavior(DisconnectedBehavior.REJECT_COMMANDS)
                    .timeoutOptions(TimeoutOptions.enabled(b.timeout))
                    .build());
            this.client = single;
        }
        this.keys = keys(stream);
        this.root = this;
    }

    /** A producer of {@code stream} on {@code root}'s client and connection (a topic's partition); closes nothing. */
    Producer(Producer root, String stream) {
        this.stream = stream;
        this.meter = Metering.CURRENT.producer(stream);
        this.timeout = root.timeout;
        this.client = root.client;
        this.keys = keys(stream);
        this.root = root;
    }

    private static byte[][] keys(String stream) {
        return new byte[][] {Worker.bytes(stream), Worker.bytes(Keys.bounds(stream)), Worker.bytes(Keys.rejected(stream))};
    }

    public static Builder builder(RedisURI uri) {
        return new Builder(Objects.requireNonNull(uri, "uri"));
    }

    public String stream() {
        return stream;
    }

    /**
     * Adds one entry (its fields in the map's iteration order: a {@code LinkedHashMap} keeps yours) and answers its
     * id. Values are {@code byte[]} as they are, anything else as its {@code String.valueOf} in UTF-8.
     */
    public String publish(Map<String, ?> fields) throws PublishException {
        return publishArguments(arguments(List.of(), fields), Tracing.Send.PLAIN, null);
    }

    /**
     * Adds entries in order, with one backlog check for them all, as many as every bounded group has room for. A
     * {@link PublishOutcomeUnknownException} concerns the whole batch: any first part of it may be written.
     */
    public Published publishBatch(List<? extends Map<String, ?>> entries) throws PublishException {
        List<List<byte[]>> flat = new ArrayList<>(entries.size());
        for (Map<String, ?> fields : entries) {
            flat.add(arguments(List.of(), fields));
        }
        return publishBatchArguments(flat);
    }

    /**
     * This producer's publishes made idempotent under the Pod's name ({@link PodName#get()}) as producer id.
     *
     * @throws IdempotenceUnsupportedException when the server has no {@code XADD ... IDMP} (Redis 8.6+)
     * @throws PublishException when the server could not be asked (unavailable, or outcome unknown)
     */
    public IdempotentProducer idempotent() throws PublishException {
        return idempotent(PodName.get());
    }

    /**
     * This producer's publishes made idempotent under {@code producerId}: stable across restarts and unique among the
     * stream's producers. It asks the server first whether its {@code XADD} takes {@code IDMP} (Redis 8.6+), so that
     * a server without it is refused here, before anything is published.
     *
     * @throws IdempotenceUnsupportedException when the server has no {@code XADD ... IDMP}
     * @throws PublishException when the server could not be asked (unavailable, or outcome unknown)
     */
    public IdempotentProducer idempotent(String producerId) throws PublishException {
        if (producerId == null || producerId.isEmpty()) {
            throw new IllegalArgumentException("the producer id is empty: give one stable across restarts, e.g. the Pod's name");
        }
        IdempotentProducer.check(this);
        return new IdempotentProducer(this, producerId);
    }

    /** Closes the connection and the producer's client. */
    @Override
    public synchronized void close() {
        if (root != this) {
            return;
        }
        if (connection != null) {
            connection.close();
        }
        client.shutdown();
    }

    /**
     * One publish of {@code args} (IDMP's ids first when idempotent, then the entry's fields) and its trace context
     * last, in a {@code send} span of its own. An idempotent publish ({@code carried} not {@code null}) sends the
     * trace fields of an earlier attempt of its message id whose outcome was unknown or unavailable, and keeps its
     * own when this one's is.
     */
    String publishArguments(List<byte[]> args, Tracing.Send send, Carried carried) throws PublishException {
        Tracing.Sending sending = Tracing.CURRENT.sending(stream, send,
                carried == null ? null : carried.take(send.messageId()));
        List<byte[]> all = new ArrayList<>(args.size() + sending.fields.size());
        all.addAll(args);
        all.addAll(sending.fields);
        String id;
        try {
            id = new String(call(Script.BOUNDED_PUBLISH, ScriptOutputType.VALUE, all.toArray(new byte[0][])),
                    StandardCharsets.UTF_8);
        } catch (PublishException e) {
            if (carried != null && (e instanceof PublishOutcomeUnknownException || e instanceof PublishUnavailableException)) {
                carried.keep(send.messageId(), sending.fields);
            }
            meter.add(Metering.Sent.of(e), 1);
            sending.failed(e);
            throw e;
        }
        meter.add(Metering.Sent.SENT, 1);
        sending.sent(id);
        return id;
    }

    Published publishBatchArguments(List<List<byte[]>> entries) throws PublishException {
        if (entries.isEmpty()) {
            return new Published(List.of(), Optional.empty());
        }
        // One span for the batch, whose context every entry carries.
        Tracing.Sending sending = Tracing.CURRENT.sending(stream, Tracing.Send.batch(entries.size()), null);
        List<byte[]> args = new ArrayList<>();
        args.add(Worker.bytes(Integer.toString(entries.size())));
        for (List<byte[]> entry : entries) {
            args.add(Worker.bytes(Integer.toString(entry.size() + sending.fields.size())));
            args.addAll(entry);
            args.addAll(sending.fields);
        }
        List<?> reply;
        try {
            reply = call(Script.BOUNDED_PUBLISH_BATCH, ScriptOutputType.MULTI, args.toArray(new byte[0][]));
        } catch (PublishException e) {
            meter.add(Metering.Sent.of(e), entries.size());
            sending.failed(e);
            throw e;
        }
        sending.sent(null);
        List<String> ids = new ArrayList<>();
        for (Object id : (List<?>) reply.get(0)) {
            ids.add(new String((byte[]) id, StandardCharsets.UTF_8));
        }
        List<?> refusal = (List<?>) reply.get(1);
        Optional<Published.Refusal> refused = refusal.isEmpty() ? Optional.empty()
                : Optional.of(new Published.Refusal(new String((byte[]) refusal.get(0), StandardCharsets.UTF_8),
                        (Long) refusal.get(1), (Long) refusal.get(2)));
        meter.add(Metering.Sent.SENT, ids.size());
        meter.add(Metering.Sent.REFUSED, entries.size() - ids.size());
        return new Published(ids, refused);
    }

    /** {@code COMMAND DOCS <command>}: nested lists (RESP3 maps flattened to name, value, ...). */
    List<Object> commandDocs(String command) throws PublishException {
        CommandArgs<byte[], byte[]> args = new CommandArgs<>(ByteArrayCodec.INSTANCE).add("DOCS").add(command);
        return await(() -> connection().async
                .dispatch(CommandType.COMMAND, new NestedMultiOutput<>(ByteArrayCodec.INSTANCE), args)
                .toCompletableFuture());
    }

    /** {@code HGETALL key}, its names and values decoded as UTF-8. */
    Map<String, String> hash(String key) throws PublishException {
        Map<byte[], byte[]> raw = await(() -> connection().async.hgetall(Worker.bytes(key)).toCompletableFuture());
        Map<String, String> decoded = new java.util.HashMap<>();
        raw.forEach((name, value) -> decoded.put(
                new String(name, StandardCharsets.UTF_8), new String(value, StandardCharsets.UTF_8)));
        return decoded;
    }

    /** Field/value arguments after {@code prefix} (the IDMP form's three). */
    static List<byte[]> arguments(List<byte[]> prefix, Map<String, ?> fields) {
        if (fields.isEmpty()) {
            throw new IllegalArgumentException("an entry needs at least one field");
        }
        List<byte[]> args = new ArrayList<>(prefix.size() + 2 * fields.size());
        args.addAll(prefix);
        fields.forEach((name, value) -> {
            args.add(Worker.bytes(name));
            args.add(value instanceof byte[] raw ? raw : Worker.bytes(String.valueOf(value)));
        });
        return args;
    }

    private <T> T call(Script script, ScriptOutputType type, byte[][] args) throws PublishException {
        return await(() -> script.<T>run(connection().async, type, keys, args));
    }

    /** Sends a call (connecting first, once) and waits for its reply, its errors as the contract classifies them. */
    private <T> T await(Call<T> send) throws PublishException {
        try {
            // Lettuce times the command out first (TimeoutOptions); this bound is only a backstop.
            return send.start().get(timeout.toMillis() + 1000, TimeUnit.MILLISECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new PublishOutcomeUnknownException("interrupted while waiting for the reply", e);
        } catch (ExecutionException | RuntimeException e) {
            throw classify(Script.cause(e));
        } catch (TimeoutException e) {
            throw new PublishOutcomeUnknownException("no reply within " + timeout, e);
        }
    }

    /** An error of a publish as its class: refused, unavailable, failed, or outcome unknown. */
    static PublishException classify(Throwable error) {
        String message = String.valueOf(error.getMessage());
        if (error instanceof RedisCommandExecutionException) {
            Matcher refused = BACKLOG_FULL.matcher(message);
            if (refused.matches()) {
                return new PublishRefusedException(refused.group(1), Long.parseLong(refused.group(2)),
                        Long.parseLong(refused.group(3)));
            }
            String code = message.split(" ", 2)[0];
            if (UNAVAILABLE.contains(code)) {
                return new PublishUnavailableException(message, error);
            }
            // A batch that failed after its first entries were added.
            if (code.equals("PELICAN_PARTIAL")) {
                return new PublishOutcomeUnknownException(message, error);
            }
            return new PublishFailedException(message, error);
        }
        // Never sent: the first connection failed, or the connection is down and commands are rejected meanwhile.
        if (error instanceof RedisConnectionException || (error instanceof RedisException && message.startsWith(NOT_SENT))) {
            return new PublishUnavailableException(message, error);
        }
        // A connection that broke with the call on its way, a timeout: it may have reached the server.
        return new PublishOutcomeUnknownException(error.toString(), error);
    }

    private synchronized Link connection() {
        if (root != this) {
            return root.connection();
        }
        if (connection == null) {
            connection = Link.connect(client);
        }
        return connection;
    }

    /** A call to send, with what may throw while sending it (a first connection that fails) inside the wait. */
    @FunctionalInterface
    private interface Call<T> {
        CompletableFuture<T> start();
    }

    /** The options of a {@link Producer}; {@code stream} is required. */
    public static final class Builder {
        private final RedisURI uri;
        private String stream;
        private Duration timeout = Duration.ofSeconds(10);
        private ClientResources resources;
        private boolean cluster;

        private Builder(RedisURI uri) {
            this.uri = uri;
        }

        /**
         * {@code true}: the URI names a node of a Redis Cluster, and the producer connects through Lettuce's
         * {@code RedisClusterClient} (the stream's keys share its slot: each publish goes to the shard that has it).
         * Default {@code false}.
         */
        public Builder cluster(boolean cluster) {
            this.cluster = cluster;
            return this;
        }

        public Builder stream(String stream) {
            this.stream = stream;
            return this;
        }

        /** How long a publish waits for its reply before it is {@link PublishOutcomeUnknownException}. Default 10 s. */
        public Builder timeout(Duration timeout) {
            this.timeout = timeout;
            return this;
        }

        /** Lettuce's resources (event loops) to share with the application's clients; default: the client's own. */
        public Builder clientResources(ClientResources resources) {
            this.resources = resources;
            return this;
        }

        public Producer build() {
            Objects.requireNonNull(stream, "stream");
            if (stream.isEmpty() || timeout.isNegative() || timeout.isZero()) {
                throw new IllegalArgumentException("the stream must not be empty, the timeout must be positive");
            }
            return new Producer(this);
        }
    }
}
