package io.pelican.worker;

import static org.junit.jupiter.api.Assertions.fail;

import io.lettuce.core.ClientOptions;
import io.lettuce.core.Limit;
import io.lettuce.core.Range;
import io.lettuce.core.RedisClient;
import io.lettuce.core.XGroupCreateArgs;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.api.sync.RedisCommands;
import io.lettuce.core.protocol.ProtocolVersion;
import java.time.Duration;
import java.util.ArrayList;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.function.BooleanSupplier;
import java.util.function.UnaryOperator;
import java.util.logging.Level;
import java.util.logging.LogRecord;
import java.util.logging.Logger;

/** What the tests share: the server, an admin connection, reading Redis state, waiting for a condition. */
final class Support {
    static final String STREAM = "{jobs}:files";
    static final String GROUP = "workers";
    static final String CONSUMER = "worker-1";

    private static RedisClient admin;
    private static RedisCommands<String, String> commands;

    private Support() {}

    static RedisServer server() {
        return RedisServer.shared();
    }

    /**
     * A text connection to the shared server, emptied: RESP2, so that {@code XINFO} answers flat lists. Call it first
     * in each test.
     */
    static synchronized RedisCommands<String, String> fresh() {
        if (commands == null) {
            admin = RedisClient.create(server().uri());
            admin.setOptions(ClientOptions.builder().protocolVersion(ProtocolVersion.RESP2).build());
            commands = admin.connect().sync();
        }
        commands.flushall();
        return commands;
    }

    static void createGroup(RedisCommands<String, String> r) {
        r.xgroupCreate(StreamOffset.from(STREAM, "0"), GROUP, XGroupCreateArgs.Builder.mkstream());
    }

    static String add(RedisCommands<String, String> r, String... fieldsAndValues) {
        return r.xadd(STREAM, (Object[]) fieldsAndValues);
    }

    /** Delivers every new entry to {@code consumer}, as a worker's read before a restart would. */
    // Lettuce takes the offsets as generic varargs: javac calls the array it makes for one offset unchecked.
    @SuppressWarnings("unchecked")
    static void deliver(RedisCommands<String, String> r, String consumer) {
        r.xreadgroup(io.lettuce.core.Consumer.from(GROUP, consumer), StreamOffset.lastConsumed(STREAM));
    }

    static void writeSettings(RedisCommands<String, String> r, long minIdleMs, long retryAfterMs, String... extra) {
        Map<String, String> fields = new LinkedHashMap<>();
        fields.put("minIdleMs", Long.toString(minIdleMs));
        fields.put("retryAfterMs", Long.toString(retryAfterMs));
        fields.put("maxDeliveries", "5");
        for (int i = 0; i + 1 < extra.length; i += 2) {
            fields.put(extra[i], extra[i + 1]);
        }
        r.hset(Keys.settings(STREAM, GROUP), fields);
    }

    /** One pending entry, as {@code XPENDING} lists it. */
    record Pending(String id, String consumer, long idleMs, long deliveries) {}

    static List<Pending> pending(RedisCommands<String, String> r) {
        List<Pending> rows = new ArrayList<>();
        r.xpending(STREAM, GROUP, Range.unbounded(), Limit.from(1000)).forEach(p -> rows.add(
                new Pending(p.getId(), p.getConsumer(), p.getMsSinceLastDelivery(), p.getRedeliveryCount())));
        return rows;
    }

    /** The group's consumers' names ({@code XINFO CONSUMERS}, RESP2: a flat list of names and values each). */
    static List<String> consumers(RedisCommands<String, String> r) {
        List<String> names = new ArrayList<>();
        for (Object consumer : r.xinfoConsumers(STREAM, GROUP)) {
            List<?> fields = (List<?>) consumer;
            names.add(String.valueOf(fields.get(fields.indexOf("name") + 1)));
        }
        return names;
    }

    /** The highest idle time of the PEL's entries, sampled every 50 ms for {@code millis}. */
    static long maxIdleWhile(RedisCommands<String, String> r, long millis) {
        long highest = 0;
        long end = System.nanoTime() + millis * 1_000_000;
        while (System.nanoTime() < end) {
            for (Pending p : pending(r)) {
                highest = Math.max(highest, p.idleMs());
            }
            RedisServer.sleep(50);
        }
        return highest;
    }

    static void eventually(BooleanSupplier check, Duration within, String what) {
        long deadline = System.nanoTime() + within.toNanos();
        while (!check.getAsBoolean()) {
            if (System.nanoTime() > deadline) {
                fail("timed out waiting for " + what);
            }
            RedisServer.sleep(20);
        }
    }

    static void eventually(BooleanSupplier check, String what) {
        eventually(check, Duration.ofSeconds(5), what);
    }

    /** A worker on the shared server as {@link #CONSUMER}, its options changed by {@code options}. */
    static Worker worker(Handler handler, UnaryOperator<Worker.Builder> options) {
        return options.apply(Worker.builder(server().uri()).stream(STREAM).group(GROUP).consumer(CONSUMER)
                .handler(handler)).build();
    }

    static Worker worker(Handler handler) {
        return worker(handler, b -> b);
    }

    /** The worker's log records while it is open: {@code try (Logs logs = new Logs()) { ... }}. */
    static final class Logs extends java.util.logging.Handler implements AutoCloseable {
        private static final Logger LOGGER = Logger.getLogger("io.pelican.worker");
        private final List<LogRecord> records = new CopyOnWriteArrayList<>();

        Logs() {
            LOGGER.addHandler(this);
        }

        @Override
        public void publish(LogRecord record) {
            records.add(record);
        }

        @Override
        public void flush() {}

        @Override
        public void close() {
            LOGGER.removeHandler(this);
        }

        /** The records at {@code level} whose message contains {@code text}. */
        List<LogRecord> at(Level level, String text) {
            return records.stream().filter(r -> r.getLevel().equals(level) && r.getMessage().contains(text)).toList();
        }

        List<String> messages() {
            return records.stream().map(LogRecord::getMessage).toList();
        }
    }
}
