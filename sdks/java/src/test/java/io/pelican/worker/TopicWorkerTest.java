package io.pelican.worker;

import static io.pelican.worker.Support.GROUP;
import static io.pelican.worker.Support.eventually;
import static io.pelican.worker.TopicSupport.TOPIC;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.Limit;
import io.lettuce.core.Range;
import io.lettuce.core.RedisURI;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.XReadArgs.StreamOffset;
import io.lettuce.core.api.sync.RedisCommands;
import io.lettuce.core.models.stream.PendingMessage;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.function.UnaryOperator;
import org.junit.jupiter.api.Test;

/** Topic workers against a real server: sharing partitions, hand-overs, expiry, refusals. */
class TopicWorkerTest {
    /** One handler run: who ran it, the partition it says, its key and the payload's {@code n}. */
    record Run(String member, int partition, String key, String n) {}

    static TopicWorker member(String name, Handler handler, UnaryOperator<TopicWorker.Builder> options) {
        return options.apply(TopicWorker.builder(Support.server().uri()).topic(TOPIC).group(GROUP).consumer(name)
                .membershipTtl(Duration.ofSeconds(3)).block(Duration.ofMillis(100)).shutdownGrace(Duration.ofSeconds(5))
                .handler(handler)).build();
    }

    static Handler recording(String member, List<Run> runs) {
        return message -> {
            runs.add(new Run(member, message.partition().orElse(-1), message.key().orElse(null), message.text("n")));
            return Outcome.done();
        };
    }

    static void publishKeyed(int count) throws PublishException {
        try (TopicProducer producer = TopicProducer.builder(Support.server().uri()).topic(TOPIC).build()) {
            for (int i = 0; i < count; i++) {
                producer.publishKeyed("key-" + i, Map.of("n", i));
            }
        }
    }

    @Test
    void twoMembersShareFourPartitionsAndEveryKeyedMessageIsHandledOnceByItsPartitionsOwner() throws PublishException {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 4, 30_000);
        List<Run> runs = new CopyOnWriteArrayList<>();
        try (TopicWorker a = member("member-a", recording("member-a", runs), b -> b);
                TopicWorker b = member("member-b", recording("member-b", runs), o -> o)) {
            a.start();
            b.start();
            eventually(() -> a.owned().size() == 2 && b.owned().size() == 2, Duration.ofSeconds(10),
                    "each member owning 2 partitions");
            assertEquals(Set.of(0, 1, 2, 3), union(a.owned(), b.owned()));
            publishKeyed(40);
            eventually(() -> runs.size() >= 40, "every message handled");
            Map<String, Set<Integer>> owners = Map.of("member-a", a.owned(), "member-b", b.owned());
            Set<String> handled = ConcurrentHashMap.newKeySet();
            for (Run run : runs) {
                assertEquals(Partitions.of(run.key(), 4), run.partition(), "the partition the handler learns");
                assertTrue(owners.get(run.member()).contains(run.partition()), run + " handled by its partition's owner");
                assertTrue(handled.add(run.n()), run + " handled once");
            }
            assertEquals(40, handled.size());
            eventually(() -> a.stats().done() + b.stats().done() == 40, "every partition's counts summed");
            assertTrue(runs.stream().anyMatch(run -> run.member().equals("member-a")));
            assertTrue(runs.stream().anyMatch(run -> run.member().equals("member-b")));
        }
    }

    @Test
    void aMemberLeavingHandsItsPartitionsToTheOtherWhichHandlesWhatFollows() throws PublishException {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 4, 30_000);
        List<Run> runs = new CopyOnWriteArrayList<>();
        TopicWorker a = member("member-a", recording("member-a", runs), o -> o);
        try (TopicWorker b = member("member-b", recording("member-b", runs), o -> o)) {
            a.start();
            b.start();
            eventually(() -> a.owned().size() == 2 && b.owned().size() == 2, Duration.ofSeconds(10), "a balanced group");
            a.close(); // its graceful stop: the partitions' workers give back, then it leaves the group
            assertEquals(List.of(), r.hkeys(Keys.owners(TOPIC, GROUP)).stream()
                    .filter(p -> r.hget(Keys.owners(TOPIC, GROUP), p).equals("member-a")).toList(), "a owns nothing");
            eventually(() -> b.owned().equals(Set.of(0, 1, 2, 3)), Duration.ofSeconds(5), "b owning every partition");
            publishKeyed(20);
            eventually(() -> runs.size() >= 20, "every message handled");
            assertTrue(runs.stream().allMatch(run -> run.member().equals("member-b")), runs.toString());
        } finally {
            a.close();
        }
    }

    @Test
    void aMemberThatStopsHeartbeatingLosesItsPartitionsAndTheOtherRunsItsPendingEntryFirst() throws Exception {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 1, 30_000);
        String stream = Keys.partitionStream(TOPIC, 0);
        // A member that joined, read an entry, and was killed: it never heartbeats again, nor leaves.
        r.eval(new String(Script.MEMBERSHIP.source, StandardCharsets.UTF_8), ScriptOutputType.MULTI,
                new String[] {Keys.members(TOPIC, GROUP), Keys.owners(TOPIC, GROUP), Keys.epochs(TOPIC, GROUP)},
                "killed", "1000", "1", "0");
        String inFlight = r.xadd(stream, Keys.KEY_FIELD, "k", "n", "in-flight");
        readAs(r, stream, "killed");
        String next = r.xadd(stream, Keys.KEY_FIELD, "k", "n", "next");
        List<String> started = new CopyOnWriteArrayList<>();
        CountDownLatch checked = new CountDownLatch(1);
        List<PendingMessage> seen = new CopyOnWriteArrayList<>();
        Handler handler = message -> {
            started.add(message.id());
            if (message.id().equals(inFlight)) {
                seen.addAll(r.xpending(stream, GROUP, Range.create(inFlight, inFlight), Limit.from(1)));
                checked.await(5, TimeUnit.SECONDS);
            }
            return Outcome.done();
        };
        try (TopicWorker survivor = member("survivor", handler, o -> o.membershipTtl(Duration.ofSeconds(1)))) {
            survivor.start();
            eventually(() -> survivor.owned().equals(Set.of(0)), Duration.ofSeconds(5), "the killed member's partition taken");
            eventually(() -> !seen.isEmpty(), "the pending entry running");
            checked.countDown();
            assertEquals("survivor", seen.get(0).getConsumer());
            assertEquals(2, seen.get(0).getRedeliveryCount(), "one delivery more than the killed member's, not two");
            eventually(() -> r.xpending(stream, GROUP).getCount() == 0, "both entries handled");
            assertEquals(List.of(inFlight, next), started, "the pending list first");
        }
    }

    @Test
    void aMemberCutOffFromTheServerStopsItsPartitionsWithinTheTtlBeforeAnotherMemberRunsThem() throws Exception {
        Duration ttl = Duration.ofSeconds(2);
        for (String ordering : List.of("None", "PerKey")) {
            RedisCommands<String, String> r = Support.fresh();
            // Leases every 300 ms: a's partition worker is waiting for a lease's reply when the ttl ends.
            TopicSupport.writeTopic(r, 1, 900, "ordering", ordering);
            CountDownLatch running = new CountDownLatch(1);
            AtomicLong stoppedAt = new AtomicLong(); // wall clock, ms: when a's handler was interrupted
            Handler hangs = message -> {
                running.countDown();
                try {
                    Thread.sleep(30_000);
                } catch (InterruptedException e) {
                    stoppedAt.set(System.currentTimeMillis());
                    throw e;
                }
                return Outcome.done();
            };
            List<Long> startedByB = new CopyOnWriteArrayList<>();
            Handler records = message -> {
                startedByB.add(System.currentTimeMillis());
                return Outcome.done();
            };
            // a's client waits 5 s for a reply (more than the ttl): a heartbeat it sends once cut off stays unanswered.
            RedisURI throughProxy;
            try (CutOff proxy = new CutOff(Support.server().port)) {
                throughProxy = RedisURI.builder().withHost("127.0.0.1").withPort(proxy.port())
                        .withTimeout(Duration.ofSeconds(5)).build();
                try (TopicWorker a = TopicWorker.builder(throughProxy).topic(TOPIC).group(GROUP).consumer("a")
                                .membershipTtl(ttl).block(Duration.ofMillis(100)).handler(hangs).build();
                        TopicWorker b = member("b", records, o -> o.membershipTtl(ttl))) {
                    a.start();
                    eventually(() -> a.owned().equals(Set.of(0)), Duration.ofSeconds(5), "a owning the partition");
                    r.xadd(Keys.partitionStream(TOPIC, 0), Keys.KEY_FIELD, "k", "n", "stuck");
                    assertTrue(running.await(5, TimeUnit.SECONDS), ordering + ": a running the entry");
                    b.start(); // one partition: a, first by name, keeps it
                    long cutAt = System.currentTimeMillis();
                    proxy.cut();
                    eventually(() -> !startedByB.isEmpty(), Duration.ofSeconds(10), ordering + ": b running the entry");
                    assertTrue(stoppedAt.get() > 0, ordering + ": a's handler still runs while b runs its entry");
                    assertTrue(stoppedAt.get() <= startedByB.get(0), ordering + ": a stopped "
                            + (stoppedAt.get() - startedByB.get(0)) + " ms after b started the entry");
                    assertTrue(stoppedAt.get() - cutAt < ttl.toMillis() + 1000,
                            ordering + ": a stopped " + (stoppedAt.get() - cutAt) + " ms after the cut");
                    assertEquals(Set.of(), a.owned(), ordering);
                    eventually(() -> r.xpending(Keys.partitionStream(TOPIC, 0), GROUP).getCount() == 0,
                            ordering + ": b acknowledged it");
                }
            }
        }
    }

    // Lettuce takes the offsets as generic varargs: javac calls the array it makes for one offset unchecked.
    @SuppressWarnings("unchecked")
    static void readAs(RedisCommands<String, String> r, String stream, String consumer) {
        r.xreadgroup(io.lettuce.core.Consumer.from(GROUP, consumer), io.lettuce.core.XReadArgs.Builder.count(1),
                StreamOffset.lastConsumed(stream));
    }

    @Test
    void aStreamWithoutATopicsSettingsIsRefusedNamingIt() {
        Support.fresh();
        TopicWorker worker = member("m", message -> Outcome.done(), o -> o);
        NotATopicException refused = assertThrows(NotATopicException.class, worker::start);
        assertTrue(refused.getMessage().contains("'orders'"), refused.getMessage());
    }

    @Test
    void anUnknownContractIsRefusedNamingTheTopic() {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 2, 30_000, "contractVersion", "3");
        TopicWorker worker = member("m", message -> Outcome.done(), o -> o);
        TopicContractException refused = assertThrows(TopicContractException.class, worker::start);
        assertEquals("3", refused.operatorVersion());
        assertTrue(refused.getMessage().contains("topic 'orders'"), refused.getMessage());
    }

    @Test
    void aPartitionWhoseSettingsChangeToAnUnknownContractStopsTheMemberSayingItKnowsContract2() throws Exception {
        for (String ordering : List.of("None", "PerKey")) {
            RedisCommands<String, String> r = Support.fresh();
            TopicSupport.writeTopic(r, 2, 300, "ordering", ordering); // settings re-read every 100 ms
            TopicWorker worker = member("m", message -> Outcome.done(), o -> o);
            CompletableFuture<Void> run = CompletableFuture.runAsync(worker::run);
            eventually(() -> worker.owned().equals(Set.of(0, 1)), Duration.ofSeconds(5), "m owning both partitions");
            r.hset(Keys.settings(Keys.partitionStream(TOPIC, 1), GROUP), "contractVersion", "3");
            ExecutionException stopped = assertThrows(ExecutionException.class, () -> run.get(10, TimeUnit.SECONDS));
            ContractVersionException version = assertInstanceOf(ContractVersionException.class, stopped.getCause());
            assertEquals("3", version.operatorVersion(), ordering);
            assertEquals(Set.of(2), version.known(), ordering);
            assertTrue(version.getMessage().contains("worker contract 3, this library knows 2"),
                    ordering + ": " + version.getMessage());
            assertEquals(Map.of(), r.hgetall(Keys.members(TOPIC, GROUP)), ordering + ": the member left");
        }
    }

    @Test
    void anUnknownOrderingIsRefusedNamingIt() {
        RedisCommands<String, String> r = Support.fresh();
        TopicSupport.writeTopic(r, 2, 30_000, "ordering", "Global");
        TopicWorker worker = member("m", message -> Outcome.done(), o -> o);
        SettingsException refused = assertThrows(SettingsException.class, worker::start);
        assertTrue(refused.getMessage().contains("ordering 'Global'"), refused.getMessage());
        assertEquals(Map.of(), r.hgetall(Keys.members(TOPIC, GROUP)), "refused before it joined");
    }

    @Test
    void aMembershipTtlOutOfRangeIsRefused() {
        for (Duration ttl : List.of(Duration.ofMillis(999), Duration.ofHours(24).plusMillis(1))) {
            IllegalArgumentException refused = assertThrows(IllegalArgumentException.class,
                    () -> member("m", message -> Outcome.done(), o -> o.membershipTtl(ttl)));
            assertTrue(refused.getMessage().contains("membership ttl must be 1 s .. 24 h"), refused.getMessage());
        }
    }

    static Set<Integer> union(Set<Integer> a, Set<Integer> b) {
        List<Integer> all = new ArrayList<>(a);
        all.addAll(b);
        return Set.copyOf(all);
    }
}
