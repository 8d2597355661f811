package io.pelican.worker;

import static io.pelican.worker.Support.GROUP;
import static io.pelican.worker.Support.eventually;
import static io.pelican.worker.TopicSupport.TOPIC;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.Limit;
import io.lettuce.core.Range;
import io.lettuce.core.api.sync.RedisCommands;
import io.lettuce.core.models.stream.PendingMessage;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.UnaryOperator;
import java.util.logging.Level;
import org.junit.jupiter.api.Test;

/** An {@code ordering: PerKey} topic: order per key, one entry of a key at once, retries in place, the cap. */
class PerKeyTest {
    private static final String STREAM = Keys.partitionStream(TOPIC, 0);

    /** A member whose concurrency (8) is above the keys' count: only the key keeps two of it apart. */
    private static TopicWorker member(Handler handler) {
        return member(handler, b -> b);
    }

    private static TopicWorker member(Handler handler, UnaryOperator<TopicWorker.Builder> options) {
        return options.apply(TopicWorker.builder(Support.server().uri()).topic(TOPIC).group(GROUP).consumer("member")
                .membershipTtl(Duration.ofSeconds(3)).block(Duration.ofMillis(100)).concurrency(8).handler(handler))
                .build();
    }

    private static List<PendingMessage> pending(RedisCommands<String, String> r, String id) {
        return r.xpending(STREAM, GROUP, Range.create(id, id), Limit.from(1));
    }

    /** A run of a handler: the message's key and n, and the deliveries the server counted when it began. */
    record Run(String key, String n, long deliveries) {}

    @Test
    void theMessagesOfAKeyRunInOrderNeverTwoAtOnceWhileKeysRunSideBySide() throws PublishException {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 1, 30_000, "ordering", "PerKey");
        Map<String, AtomicInteger> runningPerKey = new ConcurrentHashMap<>();
        AtomicInteger running = new AtomicInteger();
        AtomicInteger mostKeysAtOnce = new AtomicInteger();
        AtomicInteger mostOfAKeyAtOnce = new AtomicInteger();
        List<Run> runs = new CopyOnWriteArrayList<>();
        try (TopicProducer producer = TopicProducer.builder(Support.server().uri()).topic(TOPIC).build()) {
            for (int i = 0; i < 6; i++) {
                for (int k = 0; k < 5; k++) {
                    producer.publishKeyed("key-" + k, Map.of("n", i));
                }
            }
        }
        Handler handler = message -> {
            String key = message.key().orElseThrow();
            int ofKey = runningPerKey.computeIfAbsent(key, k -> new AtomicInteger()).incrementAndGet();
            mostOfAKeyAtOnce.accumulateAndGet(ofKey, Math::max);
            mostKeysAtOnce.accumulateAndGet(running.incrementAndGet(), Math::max);
            // The handler's work, of uneven lengths: entries of a key run side by side would end out of order.
            Thread.sleep(10 + 7 * Integer.parseInt(message.text("n")) % 30);
            runs.add(new Run(key, message.text("n"), 0));
            running.decrementAndGet();
            runningPerKey.get(key).decrementAndGet();
            return Outcome.done();
        };
        try (TopicWorker worker = member(handler)) {
            worker.start();
            assertEquals(Ordering.PER_KEY, worker.ordering());
            eventually(() -> runs.size() == 30, Duration.ofSeconds(10), "every message handled");
        }
        for (int k = 0; k < 5; k++) {
            String key = "key-" + k;
            assertEquals(List.of("0", "1", "2", "3", "4", "5"),
                    runs.stream().filter(run -> run.key().equals(key)).map(Run::n).toList(), key + " in order");
        }
        assertEquals(1, mostOfAKeyAtOnce.get(), "never two of one key at once");
        assertTrue(mostKeysAtOnce.get() >= 2, "keys side by side: at most " + mostKeysAtOnce.get() + " at once");
        assertEquals(0, r.xpending(STREAM, GROUP).getCount());
    }

    @Test
    void aFailingMessageRunsAgainInPlaceWhileItsKeyWaitsAndAnotherKeyDoesNot() {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 1, 300, "ordering", "PerKey");
        String failing = r.xadd(STREAM, Keys.KEY_FIELD, "a", "n", "a-1");
        r.xadd(STREAM, Keys.KEY_FIELD, "a", "n", "a-2");
        r.xadd(STREAM, Keys.KEY_FIELD, "b", "n", "b-1");
        List<Run> runs = new CopyOnWriteArrayList<>();
        AtomicInteger failures = new AtomicInteger();
        Handler handler = message -> {
            long deliveries = pending(r, message.id()).get(0).getRedeliveryCount();
            runs.add(new Run(message.key().orElseThrow(), message.text("n"), deliveries));
            if (message.id().equals(failing) && failures.getAndIncrement() == 0) {
                throw new IllegalStateException("the store is down");
            }
            return Outcome.done();
        };
        try (TopicWorker worker = member(handler)) {
            worker.start();
            eventually(() -> runs.size() == 4, Duration.ofSeconds(5), "a-1 twice, a-2 and b-1");
        }
        List<String> order = runs.stream().map(Run::n).toList();
        assertEquals(List.of("a-1", "a-1", "a-2"), order.stream().filter(n -> n.startsWith("a")).toList(),
                "a-1 again in place before a-2: " + order);
        assertTrue(order.indexOf("b-1") < order.lastIndexOf("a-1"), "b-1 did not wait for a's retry: " + order);
        assertEquals(List.of(1L, 2L), runs.stream().filter(run -> run.n().equals("a-1")).map(Run::deliveries).toList(),
                "the delivery counted on the server before the run again");
        assertEquals(0, r.xpending(STREAM, GROUP).getCount());
    }

    @Test
    void atTheCapTheEntryIsNoLongerLeasedAndItsKeyGoesOnOnceItLeftThePendingList() {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 1, 300, "ordering", "PerKey", "maxDeliveries", "2");
        String capped = r.xadd(STREAM, Keys.KEY_FIELD, "a", "n", "a-1");
        r.xadd(STREAM, Keys.KEY_FIELD, "a", "n", "a-2");
        List<String> runs = new CopyOnWriteArrayList<>();
        Handler handler = message -> {
            runs.add(message.text("n"));
            if (message.id().equals(capped)) {
                throw new IllegalStateException("never works");
            }
            return Outcome.done();
        };
        try (TopicWorker worker = member(handler)) {
            worker.start();
            eventually(() -> runs.size() == 2, Duration.ofSeconds(5), "a-1 run up to the cap");
            // Leases every 100 ms (minIdle / 3): an entry idle well past that is no longer leased.
            eventually(() -> !pending(r, capped).isEmpty() && pending(r, capped).get(0).getMsSinceLastDelivery() > 600,
                    Duration.ofSeconds(5), "the capped entry left to idle");
            assertEquals(List.of("a-1", "a-1"), runs, "a-2 waits behind the capped entry");
            // The operator's pass dead-letters it: it leaves the pending list.
            r.xack(STREAM, GROUP, capped);
            eventually(() -> runs.size() == 3, Duration.ofSeconds(5), "a-2 run once a-1 left the pending list");
        }
        assertEquals(List.of("a-1", "a-1", "a-2"), runs);
        assertFalse(r.hget(Keys.errors(STREAM, GROUP), capped).isEmpty(), "its last error recorded for the pass");
        assertEquals(new ArrayList<>(List.of()), new ArrayList<>(pending(r, capped)));
    }

    @Test
    void pastMaxHandlingTheRunningEntryIsNoLongerLeasedSaidOnceWhileTheEntriesBehindItStayLeased()
            throws InterruptedException {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 1, 300, "ordering", "PerKey"); // a lease every 100 ms
        String slow = r.xadd(STREAM, Keys.KEY_FIELD, "a", "n", "a-1");
        String behind = r.xadd(STREAM, Keys.KEY_FIELD, "a", "n", "a-2");
        CountDownLatch started = new CountDownLatch(1);
        CountDownLatch finish = new CountDownLatch(1);
        Handler handler = message -> {
            if (message.id().equals(slow)) {
                started.countDown();
                finish.await(10, TimeUnit.SECONDS);
            }
            return Outcome.done();
        };
        try (Support.Logs logs = new Support.Logs();
                TopicWorker worker = member(handler, b -> b.maxHandling(Duration.ofMillis(400)))) {
            worker.start();
            assertTrue(started.await(5, TimeUnit.SECONDS), "a-1 running");
            // Past maxHandling (400 ms) its lease lapses: idle well past the 100 ms between leases, while it runs.
            eventually(() -> pending(r, slow).get(0).getMsSinceLastDelivery() >= 700, Duration.ofSeconds(3),
                    "a-1 idle past maxHandling");
            assertTrue(pending(r, behind).get(0).getMsSinceLastDelivery() < 300, "a-2, queued behind it, still leased");
            assertEquals(1, logs.at(Level.WARNING, "still running after maxHandling").size(), logs.messages().toString());
            finish.countDown();
            eventually(() -> r.xpending(STREAM, GROUP).getCount() == 0, "a-1 and a-2 done");
        }
    }
}
