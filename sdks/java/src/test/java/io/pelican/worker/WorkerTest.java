package io.pelican.worker;

import static io.pelican.worker.Support.CONSUMER;
import static io.pelican.worker.Support.GROUP;
import static io.pelican.worker.Support.STREAM;
import static io.pelican.worker.Support.add;
import static io.pelican.worker.Support.consumers;
import static io.pelican.worker.Support.createGroup;
import static io.pelican.worker.Support.eventually;
import static io.pelican.worker.Support.fresh;
import static io.pelican.worker.Support.maxIdleWhile;
import static io.pelican.worker.Support.pending;
import static io.pelican.worker.Support.worker;
import static io.pelican.worker.Support.writeSettings;
import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.ClientOptions;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisURI;
import io.lettuce.core.XClaimArgs;
import io.lettuce.core.api.sync.RedisCommands;
import io.lettuce.core.codec.ByteArrayCodec;
import io.lettuce.core.protocol.ProtocolVersion;
import io.pelican.worker.Support.Logs;
import io.pelican.worker.Support.Pending;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.logging.Level;
import java.util.logging.LogRecord;
import org.junit.jupiter.api.Test;

/** The worker against a real server: what it leaves in Redis for each outcome, lease, hand-over and shutdown. */
class WorkerTest {
    private static final Duration GIVE_UP = Duration.ofSeconds(5);

    private static boolean await(CountDownLatch latch) throws InterruptedException {
        return latch.await(GIVE_UP.toMillis(), TimeUnit.MILLISECONDS);
    }

    @Test
    void doneAcknowledgesAndReadsTheOwnPelFirst() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        List<String> before = List.of(add(r, "n", "0"), add(r, "n", "1"));
        // Delivered to this consumer before a "restart": in its PEL.
        Support.deliver(r, CONSUMER);
        List<String> after = List.of(add(r, "n", "2"), add(r, "n", "3"));
        List<String> seen = new CopyOnWriteArrayList<>();
        Worker w = worker(m -> {
            seen.add(m.id());
            return Outcome.done();
        }, b -> b.concurrency(1));
        try (w) {
            w.start();
            eventually(() -> seen.size() == 4, "4 messages handled");
            eventually(() -> pending(r).isEmpty(), "an empty PEL");
        }
        List<String> expected = new ArrayList<>(before);
        expected.addAll(after);
        assertEquals(expected, seen);
        assertEquals(4, w.stats().done());
        assertEquals(0, w.stats().inFlight());
        assertEquals(0, r.exists(Keys.errors(STREAM, GROUP)));
    }

    @Test
    void anEntryWhosePayloadWasDeletedIsNotHandled() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        String gone = add(r, "n", "gone");
        String kept = add(r, "n", "kept");
        Support.deliver(r, CONSUMER);
        r.xdel(STREAM, gone);
        List<String> seen = new CopyOnWriteArrayList<>();
        try (Worker w = worker(m -> {
            seen.add(m.id());
            return Outcome.done();
        })) {
            w.start();
            eventually(() -> seen.equals(List.of(kept)), "the kept entry handled");
            RedisServer.sleep(200);
        }
        assertEquals(List.of(kept), seen);
        // Left for the operator's pass, which drops it.
        assertEquals(List.of(gone), pending(r).stream().map(Pending::id).toList());
    }

    @Test
    void fieldsAreRawBytesInOrderWithRepeatedNamesOnAClientOfTheApplicationsOnResp2() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        RedisClient app = RedisClient.create(Support.server().uri());
        app.setOptions(ClientOptions.builder().protocolVersion(ProtocolVersion.RESP2).build());
        try {
            var raw = app.connect(ByteArrayCodec.INSTANCE).sync();
            raw.xadd(bytes(STREAM), bytes("a"), new byte[] {(byte) 0xff, 0}, bytes("b"), bytes("2"), bytes("a"), bytes("3"));
            List<Message> got = new CopyOnWriteArrayList<>();
            try (Worker w = Worker.builder(app).stream(STREAM).group(GROUP).consumer(CONSUMER).handler(m -> {
                got.add(m);
                return Outcome.done();
            }).build()) {
                w.start();
                eventually(() -> got.size() == 1, "the message handled");
            }
            Message m = got.get(0);
            assertEquals(List.of(new Message.Field("a", new byte[] {(byte) 0xff, 0}), new Message.Field("b", bytes("2")),
                    new Message.Field("a", bytes("3"))), m.fields());
            assertArrayEquals(new byte[] {(byte) 0xff, 0}, m.bytes("a"));
            assertNull(m.text("a"));
            assertEquals("2", m.text("b"));
            assertNull(m.text("c"));
            // The application's client is its own: still usable after the worker closed.
            assertEquals("PONG", raw.ping());
        } finally {
            app.shutdown();
        }
    }

    @Test
    void aFailureRecordsTheErrorCutAtACharacterAndIsNotReadAgain() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 300, 60_000); // a lease tick, and a look for hand-overs, every 100 ms
        String entry = add(r, "n", "1");
        AtomicInteger runs = new AtomicInteger();
        Worker w = worker(m -> {
            runs.incrementAndGet();
            throw new IllegalArgumentException("€".repeat(2000));
        }, b -> b.block(Duration.ofMillis(50)));
        List<LogRecord> failures;
        try (Logs logs = new Logs()) {
            try (w) {
                w.start();
                eventually(() -> r.hexists(Keys.errors(STREAM, GROUP), entry), "the error recorded");
                // Several lease ticks' hand-over looks: an entry that failed here is left to the operator's retry.
                RedisServer.sleep(800);
            }
            failures = logs.at(Level.WARNING, "handler failed on " + entry);
        }
        // One line, with the class and the message, never a stack trace.
        assertEquals(1, failures.size());
        assertNull(failures.get(0).getThrown(), "a stack trace was logged");
        assertTrue(failures.get(0).getMessage().contains("IllegalArgumentException: €€"), failures.get(0).getMessage());
        assertEquals(1, runs.get());
        assertEquals(1, w.stats().failed());
        byte[] text = bytes(r.hget(Keys.errors(STREAM, GROUP), entry));
        String prefix = "IllegalArgumentException: ";
        assertEquals(prefix.length() + 3 * ((1024 - prefix.length()) / 3), text.length); // cut at a character: UTF-8
        assertTrue(new String(text, StandardCharsets.UTF_8).startsWith(prefix + "€€"));
        List<Pending> left = pending(r);
        assertEquals(1, left.size());
        assertEquals(List.of(entry, CONSUMER, 1L), List.of(left.get(0).id(), left.get(0).consumer(), left.get(0).deliveries()));
        assertEquals(List.of(CONSUMER), consumers(r)); // it still owns the failed entry: kept
    }

    @Test
    void anErrorThrownByTheHandlerIsAFailureAndTheWorkerGoesOn() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        List<String> thrown = new ArrayList<>();
        for (int i = 0; i < 5; i++) {
            thrown.add(add(r, "throw", "error"));
        }
        List<String> ordinary = List.of(add(r, "n", "1"), add(r, "n", "2"), add(r, "n", "3"));
        List<String> handled = new CopyOnWriteArrayList<>();
        Worker w = worker(m -> {
            if (m.text("throw") != null) {
                throw new StackOverflowError("deep");
            }
            handled.add(m.id());
            return Outcome.done();
        }, b -> b.concurrency(2));
        List<LogRecord> failures;
        try (Logs logs = new Logs()) {
            try (w) {
                w.start();
                eventually(() -> handled.size() == 3, "the ordinary messages handled after 5 errors");
                eventually(() -> r.hlen(Keys.errors(STREAM, GROUP)) == 5, "5 errors recorded");
            }
            failures = logs.at(Level.WARNING, "handler failed");
        }
        // One WARNING line per failure, with the id, the class and the message, never a stack trace.
        assertEquals(5, failures.size());
        for (LogRecord failure : failures) {
            assertNull(failure.getThrown());
            assertTrue(failure.getMessage().contains("StackOverflowError: deep"), failure.getMessage());
        }
        assertEquals(ordinary, handled.stream().sorted().toList());
        assertEquals(new WorkerStats(3, 0, 5, 0, 0, 0), w.stats());
        for (String id : thrown) {
            assertEquals("StackOverflowError: deep", r.hget(Keys.errors(STREAM, GROUP), id));
        }
        // Failed here, still this consumer's (never given back on shutdown): the pass retries them.
        assertEquals(thrown, pending(r).stream().map(Pending::id).toList());
        assertEquals(List.of(CONSUMER), consumers(r));
    }

    @Test
    void aFailedMessageHandedBackIsHandledAndItsErrorRemovedWithTheAck() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 300, 60_000); // a lease tick every 100 ms
        String entry = add(r, "n", "1");
        List<Object> outcomes = Collections.synchronizedList(
                new ArrayList<>(List.of(new IllegalStateException("first delivery fails"), Outcome.done())));
        Worker w = worker(m -> {
            Object outcome = outcomes.remove(0);
            if (outcome instanceof Exception e) {
                throw e;
            }
            return (Outcome) outcome;
        });
        try (w) {
            w.start();
            eventually(() -> r.hexists(Keys.errors(STREAM, GROUP), entry), "the error recorded");
            // What `strategy: Reassign` does once the entry was idle: it hands it over (here, back) with XCLAIM.
            RedisServer.sleep(1200);
            r.xclaim(STREAM, io.lettuce.core.Consumer.from(GROUP, CONSUMER), 0, entry);
            eventually(() -> pending(r).isEmpty(), "the handed-back entry acknowledged");
        }
        assertTrue(outcomes.isEmpty());
        assertFalse(r.hexists(Keys.errors(STREAM, GROUP), entry));
        assertEquals(1, w.stats().failed());
        assertEquals(1, w.stats().done());
    }

    @Test
    void doneOnARequeuedCopyRemovesItsLastError() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        String copy = add(r, "n", "1", "pelican-origin-id", "1-1", "pelican-deliveries", "2");
        r.hset(Keys.errors(STREAM, GROUP), copy, "IllegalStateException: before");
        r.hset(Keys.errors(STREAM, GROUP), "9-9", "someone else's");
        Worker w = worker(m -> Outcome.done());
        try (w) {
            w.start();
            eventually(() -> w.stats().done() == 1, "done");
        }
        assertEquals(List.of(), pending(r));
        assertEquals(Map.of("9-9", "someone else's"), r.hgetall(Keys.errors(STREAM, GROUP)));
    }

    @Test
    void terminalAcknowledgesAndCountsTheReasonOnce() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        String first = add(r, "n", "1");
        add(r, "n", "2");
        r.hset(Keys.errors(STREAM, GROUP), first, "IllegalStateException: earlier");
        Worker w = worker(m -> Outcome.terminal("RecordNotFound"));
        try (w) {
            w.start();
            eventually(() -> w.stats().terminal() == 2, "2 terminal");
        }
        assertEquals(List.of(), pending(r));
        assertEquals(Map.of("RecordNotFound", "2"), r.hgetall(Keys.terminal(STREAM, GROUP)));
        assertFalse(r.hexists(Keys.errors(STREAM, GROUP), first));
    }

    @Test
    void anInvalidReasonIsAFailureNeverAnAck() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        String entry = add(r, "n", "1");
        Worker w = worker(m -> Outcome.terminal("record not found"));
        try (w) {
            w.start();
            eventually(() -> r.hexists(Keys.errors(STREAM, GROUP), entry), "the error recorded");
        }
        assertTrue(r.hget(Keys.errors(STREAM, GROUP), entry).contains("^[A-Z][A-Za-z0-9]{0,62}$"));
        assertEquals(0, r.exists(Keys.terminal(STREAM, GROUP)));
        assertEquals(List.of(entry), pending(r).stream().map(Pending::id).toList());
        assertEquals(1, w.stats().failed());
        assertEquals(0, w.stats().terminal());
    }

    @Test
    void aHandlerAnsweringNoOutcomeFailsTheMessage() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        String entry = add(r, "n", "1");
        try (Worker w = worker(m -> null)) {
            w.start();
            eventually(() -> r.hexists(Keys.errors(STREAM, GROUP), entry), "the error recorded");
        }
        assertTrue(r.hget(Keys.errors(STREAM, GROUP), entry)
                .startsWith("IllegalStateException: the handler returned null"));
        assertEquals(List.of(entry), pending(r).stream().map(Pending::id).toList());
    }

    @Test
    void retryGivesBackCountedWithAnIdleOfMinIdle() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 7000, 50_000);
        String entry = add(r, "n", "1");
        Worker w = worker(m -> Outcome.retry());
        try (w) {
            w.start();
            eventually(() -> w.stats().retried() == 1, "the retry");
        }
        Pending p = pending(r).get(0);
        // Still this consumer's, the delivery counted (1: the read), idle set to minIdle for the pass's backoff.
        assertEquals(List.of(entry, CONSUMER, 1L), List.of(p.id(), p.consumer(), p.deliveries()));
        assertTrue(p.idleMs() >= 7000 && p.idleMs() < 9000, "idle " + p.idleMs());
    }

    @Test
    void theLeaseKeepsASlowHandlersEntryFromGoingIdle() throws InterruptedException {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 600, 60_000); // a lease every 200 ms
        add(r, "n", "1");
        CountDownLatch started = new CountDownLatch(1);
        Worker w = worker(m -> {
            started.countDown();
            Thread.sleep(2000); // over 3 x minIdle
            return Outcome.done();
        });
        long highest;
        Pending during;
        try (w) {
            w.start();
            assertTrue(await(started));
            highest = maxIdleWhile(r, 1800);
            during = pending(r).get(0);
            eventually(() -> pending(r).isEmpty(), "the ACK");
        }
        assertTrue(highest < 600, "highest idle " + highest);
        assertEquals(1, during.deliveries()); // a lease leaves the count alone
        assertEquals(1, w.stats().done());
    }

    @Test
    void settingsAreReReadAtEveryLeaseTick() throws InterruptedException {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 3000, 60_000); // a lease every second
        add(r, "n", "1");
        CountDownLatch started = new CountDownLatch(1);
        Worker w = worker(m -> {
            started.countDown();
            Thread.sleep(3000);
            return Outcome.done();
        });
        long highest;
        try (w) {
            w.start();
            assertTrue(await(started));
            writeSettings(r, 300, 60_000); // a lease every 100 ms from the next tick on
            RedisServer.sleep(1200);
            highest = maxIdleWhile(r, 1500);
            assertEquals(300, w.settings().orElseThrow().minIdleMs());
        }
        assertTrue(highest < 300, "highest idle " + highest);
    }

    @Test
    void pastMaxHandlingTheLeaseIsNoLongerExtended() throws InterruptedException {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 300, 60_000);
        add(r, "n", "1");
        CountDownLatch started = new CountDownLatch(1);
        Pending p;
        try (Logs logs = new Logs();
                Worker w = worker(m -> {
                    started.countDown();
                    Thread.sleep(1600);
                    return Outcome.done();
                }, b -> b.maxHandling(Duration.ofMillis(400)))) {
            w.start();
            assertTrue(await(started));
            RedisServer.sleep(1300);
            p = pending(r).get(0);
            assertEquals(1, logs.at(Level.WARNING, "still running after maxHandling").size(), logs.messages().toString());
        }
        assertTrue(p.idleMs() >= 700, "idle " + p.idleMs());
    }

    @Test
    void shutdownGivesBackUnownedWithTheDeliveryUncountedAndLeavesTheGroup() throws InterruptedException {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 60_000, 4321);
        String entry = add(r, "n", "1");
        CountDownLatch started = new CountDownLatch(1);
        Worker w = worker(m -> {
            started.countDown();
            Thread.sleep(60_000);
            return Outcome.done();
        }, b -> b.shutdownGrace(Duration.ofMillis(300)));
        try (Logs logs = new Logs()) {
            try (w) {
                w.start();
                assertTrue(await(started));
                Pending p = pending(r).get(0);
                assertEquals(List.of(CONSUMER, 1L), List.of(p.consumer(), p.deliveries()));
            }
            assertEquals(1, logs.at(Level.INFO, "shutdown: 1 messages given back").size(), logs.messages().toString());
        }
        Pending p = pending(r).get(0);
        assertEquals(List.of(entry, "", 0L), List.of(p.id(), p.consumer(), p.deliveries()));
        assertTrue(p.idleMs() >= 4321 && p.idleMs() < 6000, "idle " + p.idleMs());
        assertEquals(new WorkerStats(0, 0, 0, 0, 1, 0), w.stats());
        assertFalse(consumers(r).contains(CONSUMER)); // it owns nothing any more: deleted
    }

    @Test
    void aReadInFlightAtTheStopGivesBackWhatItBroughtUnhandled() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 60_000, 4321);
        List<String> seen = new CopyOnWriteArrayList<>();
        Worker w = worker(m -> {
            seen.add(m.id());
            return Outcome.done();
        }, b -> b.block(Duration.ofSeconds(3)));
        w.start();
        eventually(() -> consumers(r).contains(CONSUMER), "the first read");
        RedisServer.sleep(300); // the blocking read is on its way
        CompletableFuture<Void> closing = CompletableFuture.runAsync(w::close);
        RedisServer.sleep(100);
        // The read in flight is awaited: what it brings now is delivered to this consumer, and given back.
        String entry = add(r, "n", "1");
        closing.join();
        assertEquals(List.of(), seen);
        Pending p = pending(r).get(0);
        assertEquals(List.of(entry, "", 0L), List.of(p.id(), p.consumer(), p.deliveries()));
        assertEquals(1, w.stats().abandoned());
        assertFalse(consumers(r).contains(CONSUMER));
    }

    @Test
    void shutdownLetsHandlersFinishWithinTheGrace() throws InterruptedException {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        add(r, "n", "1");
        CountDownLatch started = new CountDownLatch(1);
        Worker w = worker(m -> {
            started.countDown();
            Thread.sleep(500);
            return Outcome.done();
        }, b -> b.shutdownGrace(Duration.ofSeconds(5)));
        try (w) {
            w.start();
            assertTrue(await(started));
        }
        assertEquals(1, w.stats().done());
        assertEquals(0, w.stats().abandoned());
        assertEquals(List.of(), pending(r));
        assertEquals(List.of(), consumers(r)); // given back nothing, and deleted all the same
    }

    @Test
    void aHandOverIsTakenUpAtTheNextLeaseTicksWithItsCountUnchanged() throws InterruptedException {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 3000, 60_000); // a lease tick every second
        String entry = add(r, "n", "1");
        Support.deliver(r, "other");
        CountDownLatch handling = new CountDownLatch(1);
        Worker w = worker(m -> {
            handling.countDown();
            Thread.sleep(300);
            return Outcome.done();
        }, b -> b.block(Duration.ofSeconds(4))); // its age does not delay the hand-over: the read's next is in 4 s
        Pending p;
        long took;
        try (w) {
            w.start();
            eventually(() -> readBlocked(r), "the blocking read");
            // What `strategy: Reassign` does: XCLAIM to this worker's name, the delivery counted.
            r.xclaim(STREAM, io.lettuce.core.Consumer.from(GROUP, CONSUMER), XClaimArgs.Builder.minIdleTime(0).retryCount(2),
                    entry);
            long handedOver = System.nanoTime();
            assertTrue(handling.await(3, TimeUnit.SECONDS), "not taken up within 3 lease ticks");
            took = (System.nanoTime() - handedOver) / 1_000_000;
            p = pending(r).get(0);
            eventually(() -> pending(r).isEmpty(), "the ACK");
        }
        assertTrue(took < 3000, "taken up after " + took + " ms");
        assertEquals(List.of(CONSUMER, 2L), List.of(p.consumer(), p.deliveries())); // lease.lua and XRANGE: not counted
        assertEquals(1, w.stats().done());
    }

    @Test
    void anEntryAReadDeliveredIsNoHandOverWhileItsReplyIsOnItsWay() throws Exception {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 600, 60_000); // a lease tick every 200 ms
        List<String> runs = new CopyOnWriteArrayList<>();
        String entry;
        Worker w;
        try (HeldRead proxy = new HeldRead(Support.server().port, "held by the proxy")) {
            w = Worker.builder(RedisURI.create("redis://127.0.0.1:" + proxy.port())).stream(STREAM).group(GROUP)
                    .consumer(CONSUMER).block(Duration.ofSeconds(1)).handler(m -> {
                        runs.add(m.id());
                        return Outcome.done();
                    }).build();
            try (w) {
                w.start();
                entry = add(r, "n", "held by the proxy");
                eventually(() -> pending(r).size() == 1, "the read's delivery");
                // In the worker's PEL, the reply that brings it held back: the lease ticks look at the PEL meanwhile.
                String heartbeats = Keys.consumers(STREAM, GROUP);
                for (int tick = 0; tick < 3; tick++) {
                    String before = r.hget(heartbeats, CONSUMER);
                    eventually(() -> !Objects.equals(r.hget(heartbeats, CONSUMER), before), "the next lease tick");
                }
                int reads = proxy.reads();
                proxy.release();
                // The next read is sent once what the held one brought was handled.
                eventually(() -> proxy.reads() > reads, "the next read");
            }
        }
        assertEquals(List.of(entry), runs);
        assertEquals(1, w.stats().done());
        assertEquals(List.of(), pending(r));
    }

    /** A client waits in a blocking XREADGROUP (CLIENT LIST: flags b, cmd xreadgroup). */
    private static boolean readBlocked(RedisCommands<String, String> r) {
        return r.clientList().lines().map(line -> List.of(line.split(" ")))
                .anyMatch(fields -> fields.contains("flags=b") && fields.contains("cmd=xreadgroup"));
    }

    @Test
    void theHeartbeatIsWrittenAtEveryLeaseTickWhileIdle() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 300, 60_000); // a lease tick every 100 ms
        String heartbeats = Keys.consumers(STREAM, GROUP);
        try (Worker w = worker(m -> Outcome.done())) {
            w.start();
            eventually(() -> r.hget(heartbeats, CONSUMER) != null, "the first heartbeat");
            long first = Long.parseLong(r.hget(heartbeats, CONSUMER));
            eventually(() -> Long.parseLong(r.hget(heartbeats, CONSUMER)) > first, "the heartbeat advancing");
            long now = Long.parseLong(r.time().get(0)) * 1000;
            assertTrue(Math.abs(now - first) < 5000, "the server's time in ms: " + first);
            assertEquals(List.of(), pending(r)); // nothing to lease: the heartbeat alone
        }
    }

    @Test
    void noGroupIsWaitedOutSaidOnceAndTheGroupNeverCreated() {
        RedisCommands<String, String> r = fresh();
        List<String> seen = new CopyOnWriteArrayList<>();
        try (Logs logs = new Logs()) {
            try (Worker w = worker(m -> {
                seen.add(m.id());
                return Outcome.done();
            })) {
                w.start();
                RedisServer.sleep(1500);
                assertEquals(0, r.exists(STREAM));
                add(r, "n", "0");
                RedisServer.sleep(500);
                assertEquals(List.of(), r.xinfoGroups(STREAM));
                createGroup(r);
                String entry = add(r, "n", "1");
                eventually(() -> seen.size() == 2, Duration.ofSeconds(12), "both entries handled");
                assertEquals(entry, seen.get(1));
            }
            assertEquals(1, logs.at(Level.WARNING, "does not exist").size(), logs.messages().toString());
        }
    }

    @Test
    void anUnknownContractVersionRefusesToStart() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        writeSettings(r, 1000, 60_000, "contractVersion", "2");
        add(r, "n", "1");
        Worker w = worker(m -> {
            throw new AssertionError("no message may be read");
        });
        ContractVersionException refused = assertThrows(ContractVersionException.class, w::start);
        assertTrue(refused.getMessage().contains("worker contract 2"));
        assertTrue(refused.getMessage().contains("knows 1"));
        assertTrue(refused.getMessage().contains("upgrade the library"));
        w.close();
        // Nothing was read.
        assertEquals(List.of(), pending(r));
        List<?> group = (List<?>) r.xinfoGroups(STREAM).get(0);
        assertEquals("0-0", group.get(group.indexOf("last-delivered-id") + 1));
        assertThrows(IllegalStateException.class, w::start);
    }

    @Test
    void anUnknownContractVersionMetWhileRunningShutsDownGracefullyAndRunThrowsIt() throws Exception {
        RedisCommands<String, String> r = fresh();
        createGroup(r); // no settings yet: a lease tick every second
        String first = add(r, "n", "1");
        CountDownLatch started = new CountDownLatch(1);
        CountDownLatch finish = new CountDownLatch(1);
        List<String> handled = new CopyOnWriteArrayList<>();
        Worker w = worker(m -> {
            handled.add(m.id());
            started.countDown();
            assertTrue(await(finish));
            return Outcome.done();
        }, b -> b.concurrency(1));
        try (Logs logs = new Logs()) {
            CompletableFuture<Void> running = CompletableFuture.runAsync(w::run);
            assertTrue(await(started));
            add(r, "n", "2");
            // Only the version: it is read first, whatever else the hash holds.
            r.hset(Keys.settings(STREAM, GROUP), "contractVersion", "2.0");
            eventually(() -> !logs.at(Level.SEVERE, "worker contract 2.0").isEmpty(),
                    "the version met at a lease tick");
            finish.countDown(); // the handler running finishes within the grace
            eventually(() -> !consumers(r).contains(CONSUMER), "the worker left the group");
            ExecutionException thrown = assertThrows(ExecutionException.class, () -> running.get(5, TimeUnit.SECONDS));
            ContractVersionException version = assertInstanceOf(ContractVersionException.class, thrown.getCause());
            assertEquals("2.0", version.operatorVersion());
            assertEquals(1, logs.at(Level.SEVERE, "worker contract 2.0").size()); // said once
        }
        assertEquals(List.of(first), handled); // never another message
        assertEquals(1, w.stats().done());
        assertTrue(pending(r).stream().noneMatch(p -> p.id().equals(first) || p.consumer().equals(CONSUMER)));
    }

    @Test
    void aBlockOf0OrAtTheClientsTimeoutIsRefusedWhenTheWorkerIsBuilt() {
        // The RedisURI's timeout: 60 s by default.
        for (Duration block : List.of(Duration.ZERO, Duration.ofNanos(500_000), Duration.ofSeconds(60))) {
            IllegalArgumentException refused = assertThrows(IllegalArgumentException.class,
                    () -> worker(m -> Outcome.done(), b -> b.block(block)), block.toString());
            assertTrue(refused.getMessage().startsWith("block "), refused.getMessage());
        }
        RedisURI shortTimeout = RedisURI.builder(Support.server().uri()).withTimeout(Duration.ofSeconds(2)).build();
        assertThrows(IllegalArgumentException.class, () -> Worker.builder(shortTimeout).stream(STREAM).group(GROUP)
                .handler(m -> Outcome.done()).block(Duration.ofSeconds(2)).build());
        // A client of the application's: its timeout is known once connected, before anything is read.
        RedisClient app = RedisClient.create(shortTimeout);
        try {
            Worker w = Worker.builder(app).stream(STREAM).group(GROUP).handler(m -> Outcome.done())
                    .block(Duration.ofSeconds(3)).build();
            IllegalArgumentException refused = assertThrows(IllegalArgumentException.class, w::start);
            assertTrue(refused.getMessage().startsWith("block "), refused.getMessage());
        } finally {
            app.shutdown();
        }
    }

    @Test
    void concurrencyBoundsTheHandlersRunning() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        for (int i = 0; i < 8; i++) {
            add(r, "n", Integer.toString(i));
        }
        AtomicInteger runningNow = new AtomicInteger();
        AtomicInteger highest = new AtomicInteger();
        Worker w = worker(m -> {
            highest.accumulateAndGet(runningNow.incrementAndGet(), Math::max);
            Thread.sleep(100);
            runningNow.decrementAndGet();
            return Outcome.done();
        }, b -> b.concurrency(3));
        try (w) {
            w.start();
            eventually(() -> w.stats().done() == 8, "8 done");
        }
        assertEquals(3, highest.get());
    }

    @Test
    void aScriptFlushedFromTheServerIsRunBySource() {
        RedisCommands<String, String> r = fresh();
        createGroup(r);
        add(r, "n", "1");
        add(r, "n", "2");
        r.scriptFlush();
        Worker w = worker(m -> Outcome.terminal("RecordNotFound"), b -> b.concurrency(1));
        try (w) {
            w.start();
            eventually(() -> w.stats().terminal() == 2, "2 terminal");
        }
        assertEquals(Map.of("RecordNotFound", "2"), r.hgetall(Keys.terminal(STREAM, GROUP)));
    }

    private static byte[] bytes(String text) {
        return text.getBytes(StandardCharsets.UTF_8);
    }
}
