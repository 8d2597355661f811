package io.pelican.worker.conformance;

import io.lettuce.core.RedisURI;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.resource.ClientResources;
import io.lettuce.core.resource.DefaultClientResources;
import io.pelican.worker.ContractVersionException;
import io.pelican.worker.IdempotentProducer;
import io.pelican.worker.InvalidReasonException;
import io.pelican.worker.Message;
import io.pelican.worker.NotATopicException;
import io.pelican.worker.Outcome;
import io.pelican.worker.PodName;
import io.pelican.worker.Producer;
import io.pelican.worker.PublishException;
import io.pelican.worker.PublishOutcomeUnknownException;
import io.pelican.worker.PublishUnavailableException;
import io.pelican.worker.SettingsException;
import io.pelican.worker.TopicContractException;
import io.pelican.worker.TopicWorker;
import io.pelican.worker.Worker;
import java.io.IOException;
import java.io.PrintStream;
import java.io.UncheckedIOException;
import java.time.Duration;
import java.util.Map;

/**
 * The conformance worker (contract/README.md, "The conformance worker"), run from the repository root:
 *
 * <pre>
 * java -cp sdks/java/target/pelican-worker.jar:sdks/java/target/lib/* io.pelican.worker.conformance.ConformanceWorker
 * </pre>
 *
 * <p>Configured by environment: {@code REDIS_URL}, {@code STREAM}, {@code GROUP}, {@code CONSUMER} (default: the
 * Pod's name) and {@code SHUTDOWN_GRACE_MS}. Its handler obeys the message: field {@code ms} = how long it takes,
 * field {@code handle} = {@code done} | {@code retry} | {@code fail} | {@code terminal:<Reason>} | {@code exit} (the
 * process exits at once with status 3). It prints one JSON line per handler run that finished on stdout, exits 0
 * after a SIGTERM once its shutdown is complete, and 4 (after its shutdown) when the operator speaks a contract
 * version this library does not know.
 *
 * <p>With {@code SENTINEL_MASTER=<name>}, {@code REDIS_URL} names a sentinel, and Lettuce asks it for the primary
 * monitored under that name (a {@link RedisURI} with a sentinel), again whenever it reconnects.
 *
 * <p>With {@code TOPIC=<T>} instead of {@code STREAM} it is a member of topic {@code T}'s group: a {@link TopicWorker}
 * named {@code CONSUMER}, its membership ttl {@code MEMBERSHIP_TTL_MS} when set, the same handler; each run line also
 * says {@code partition}, {@code key} ({@code null} without one), {@code startedAt} and {@code endedAt} (the wall
 * clock, ms). A topic it refuses (none there, a contract or an ordering it does not know) exits 4.
 *
 * <p>With {@code REDIS_CLUSTER=1} (either mode), {@code REDIS_URL} names a primary of a Redis Cluster, and the
 * program connects through Lettuce's {@code RedisClusterClient}.
 *
 * <p>With {@code MODE=publish} it is a producer instead: it publishes {@code MESSAGES} messages idempotently (message
 * ids {@code m-0}, {@code m-1}, ...; the producer id is the Pod's name), each published again with the same id until
 * it answers an entry id, one JSON line per attempt.
 *
 * <p>With {@code OTEL_EXPORTER_OTLP_ENDPOINT} set, the library's spans go to it over OTLP ({@link ConformanceTraces});
 * whichever way the program ends, the spans still queued are exported first (for at most 5 s).
 *
 * <p>With {@code METRICS_PORT} set (a worker of a stream), the worker's metrics are served at
 * {@code http://127.0.0.1:<port>/metrics} ({@link ConformanceMetrics}).
 */
public final class ConformanceWorker {
    private static final PrintStream OUT = System.out;

    private ConformanceWorker() {}

    public static void main(String[] args) throws PublishException, InterruptedException {
        ConformanceTraces.exportIfConfigured();
        try {
            serve();
        } finally {
            ConformanceTraces.shutdown();
        }
    }

    /** Ends the JVM at once with {@code status} (no hook runs), once the queued spans are exported. */
    private static void halt(int status) {
        ConformanceTraces.shutdown();
        OUT.flush();
        Runtime.getRuntime().halt(status);
    }

    private static void serve() throws PublishException, InterruptedException {
        RedisURI uri = uri(System.getenv().getOrDefault("REDIS_URL", "redis://127.0.0.1:6379"), env("SENTINEL_MASTER"));
        boolean cluster = "1".equals(env("REDIS_CLUSTER"));
        if ("publish".equals(env("MODE"))) {
            publish(uri, cluster, required("STREAM"), Integer.parseInt(required("MESSAGES")));
            return;
        }
        // A Redis Cluster's client, the program's own: shut down after the worker.
        RedisClusterClient clusterClient = cluster ? RedisClusterClient.create(uri) : null;
        String consumer = env("CONSUMER") != null ? env("CONSUMER") : PodName.get();
        String grace = env("SHUTDOWN_GRACE_MS");
        Duration shutdownGrace = grace != null ? Duration.ofMillis(Long.parseLong(grace)) : Duration.ofSeconds(20);
        String topic = env("TOPIC");
        AutoCloseable worker;
        Runnable run;
        if (topic != null) {
            String ttl = env("MEMBERSHIP_TTL_MS");
            TopicWorker member = (clusterClient != null ? TopicWorker.builder(clusterClient) : TopicWorker.builder(uri))
                    .topic(topic)
                    .group(required("GROUP"))
                    .consumer(consumer)
                    .shutdownGrace(shutdownGrace)
                    .membershipTtl(ttl != null ? Duration.ofMillis(Long.parseLong(ttl)) : TopicWorker.DEFAULT_MEMBERSHIP_TTL)
                    .handler(message -> handle(message, consumer, true))
                    .build();
            worker = member;
            run = member::run;
        } else {
            Worker plain = (clusterClient != null ? Worker.builder(clusterClient) : Worker.builder(uri))
                    .stream(required("STREAM"))
                    .group(required("GROUP"))
                    .consumer(consumer)
                    .shutdownGrace(shutdownGrace)
                    .handler(message -> handle(message, consumer, false))
                    .build();
            worker = plain;
            run = plain::run;
            String metricsPort = System.getenv("METRICS_PORT");
            if (metricsPort != null && !metricsPort.isEmpty()) {
                try {
                    ConformanceMetrics.serve(plain, Integer.parseInt(metricsPort));
                } catch (IOException e) {
                    throw new UncheckedIOException(e);
                }
            }
        }
        // Registered before start(): a SIGTERM while starting still ends in a complete shutdown. halt(0), because a
        // JVM ended by a signal exits 143 once its hooks have run.
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            try {
                worker.close();
            } catch (Exception e) {
                e.printStackTrace();
            }
            if (clusterClient != null) {
                clusterClient.shutdown();
            }
            halt(0);
        }, "conformance-shutdown"));
        try {
            run.run(); // until the hook's close()
        } catch (NotATopicException | TopicContractException | SettingsException e) {
            // A topic this library refuses: nothing was read.
            System.err.println("conformance worker: " + e.getMessage());
            halt(4);
        } catch (ContractVersionException e) {
            // After its shutdown; not through the hook, which would exit 0.
            System.err.println("conformance worker: " + e.getMessage());
            halt(4);
        } catch (RuntimeException e) {
            e.printStackTrace();
            halt(1); // not through the hook, which would exit 0
        }
    }

    /** {@code url} itself, or with {@code sentinelMaster} the primary the sentinel it names answers for that name. */
    static RedisURI uri(String url, String sentinelMaster) {
        RedisURI named = RedisURI.create(url);
        if (sentinelMaster == null) {
            return named;
        }
        return RedisURI.Builder.sentinel(named.getHost(), named.getPort(), sentinelMaster)
                .withDatabase(named.getDatabase())
                .build();
    }

    /**
     * An attempt whose outcome is unknown (its reply was lost) or that found the server unavailable is published again
     * with the same message id, as the contract says: the server answers the first entry's id.
     */
    static void publish(RedisURI uri, boolean cluster, String stream, int messages)
            throws PublishException, InterruptedException {
        ClientResources resources = DefaultClientResources.create();
        try {
            for (int n = 0; n < messages; n++) {
                String message = "m-" + n;
                while (true) {
                    // A producer of its own per attempt, as the other libraries' programs make; one set of event loops.
                    try (Producer producer = Producer.builder(uri).stream(stream).cluster(cluster)
                            .clientResources(resources).build()) {
                        IdempotentProducer idempotent = producer.idempotent();
                        String id = idempotent.publish(message, Map.of("n", Integer.toString(n)));
                        line("{\"message\": " + json(message) + ", \"outcome\": \"published\", \"id\": " + json(id) + "}");
                        break;
                    } catch (PublishOutcomeUnknownException | PublishUnavailableException e) {
                        line("{\"message\": " + json(message) + ", \"outcome\": \"unknown\"}");
                        Thread.sleep(100);
                    }
                }
            }
        } finally {
            resources.shutdown();
        }
    }

    /** The message's orders; in a topic ({@code topic}), each line also says where the message is from and when. */
    static Outcome handle(Message message, String consumer, boolean topic) throws InterruptedException {
        Run run = new Run(message, consumer, topic, System.currentTimeMillis());
        String msText = message.text("ms");
        long ms = msText != null && !msText.isEmpty() ? Long.parseLong(msText) : 0;
        if (ms > 0) {
            Thread.sleep(ms); // interrupted when the shutdown grace runs out: the run did not finish, nothing printed
        }
        // HANDLE overrides every message's handle (a worker that fails whatever it reads).
        String override = System.getenv("HANDLE");
        String asked = override != null && !override.isEmpty() ? override : message.text("handle");
        String action = asked != null ? asked : "done";
        if (action.equals("exit")) {
            run.report("exit", ms, run.startedAt);
            halt(3);
        }
        if (action.equals("fail")) {
            run.report("fail", ms, System.currentTimeMillis());
            throw new IllegalStateException("the message asked the conformance worker to fail");
        }
        if (action.startsWith("terminal:")) {
            Outcome outcome;
            try {
                outcome = Outcome.terminal(action.substring("terminal:".length()));
            } catch (InvalidReasonException e) {
                run.report("fail", ms, System.currentTimeMillis()); // refused before anything is written: a failure
                throw e;
            }
            run.report("terminal", ms, System.currentTimeMillis());
            return outcome;
        }
        if (action.equals("retry")) {
            run.report("retry", ms, System.currentTimeMillis());
            return Outcome.retry();
        }
        run.report("done", ms, System.currentTimeMillis());
        return Outcome.done();
    }

    /** One handler run, reported once it ends. */
    private record Run(Message message, String consumer, boolean topic, long startedAt) {
        void report(String outcome, long ms, long endedAt) {
            StringBuilder line = new StringBuilder("{\"id\": " + json(message.id()) + ", \"consumer\": "
                    + json(consumer) + ", \"outcome\": " + json(outcome) + ", \"ms\": " + ms);
            if (topic) {
                line.append(", \"partition\": ").append(message.partition().orElse(-1))
                        .append(", \"key\": ").append(message.key().map(ConformanceWorker::json).orElse("null"))
                        .append(", \"startedAt\": ").append(startedAt)
                        .append(", \"endedAt\": ").append(endedAt);
            }
            line(line.append('}').toString());
        }
    }

    private static void line(String json) {
        synchronized (OUT) {
            OUT.println(json);
            OUT.flush();
        }
    }

    static String json(String text) {
        StringBuilder out = new StringBuilder("\"");
        for (char c : text.toCharArray()) {
            switch (c) {
                case '"' -> out.append("\\\"");
                case '\\' -> out.append("\\\\");
                case '\n' -> out.append("\\n");
                case '\r' -> out.append("\\r");
                case '\t' -> out.append("\\t");
                default -> {
                    if (c < 0x20) {
                        out.append(String.format("\\u%04x", (int) c));
                    } else {
                        out.append(c);
                    }
                }
            }
        }
        return out.append('"').toString();
    }

    private static String env(String name) {
        String value = System.getenv(name);
        return value == null || value.isEmpty() ? null : value;
    }

    private static String required(String name) {
        String value = env(name);
        if (value == null) {
            throw new IllegalArgumentException(name + " is not set");
        }
        return value;
    }
}
