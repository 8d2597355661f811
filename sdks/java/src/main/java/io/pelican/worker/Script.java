package io.pelican.worker;

import io.lettuce.core.RedisNoScriptException;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.cluster.api.async.RedisClusterAsyncCommands;
import java.io.IOException;
import java.io.InputStream;
import java.io.UncheckedIOException;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.HexFormat;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.ExecutionException;

/**
 * One of the contract's scripts, shipped in this jar ({@code io/pelican/worker/scripts/*.lua}, byte for byte the
 * repository's {@code contract/scripts}), run by {@code EVALSHA} with a fall back to {@code EVAL} on {@code NOSCRIPT}
 * (which also loads it for the next call).
 */
final class Script {
    static final Script LEASE = load("lease");
    static final Script GIVE_BACK = load("give_back");
    static final Script TERMINAL_ACK = load("terminal_ack");
    static final Script BOUNDED_PUBLISH = load("bounded_publish");
    static final Script BOUNDED_PUBLISH_BATCH = load("bounded_publish_batch");
    static final Script MEMBERSHIP = load("membership");

    final byte[] source;
    final String sha;

    private Script(byte[] source) {
        this.source = source;
        try {
            this.sha = HexFormat.of().formatHex(MessageDigest.getInstance("SHA-1").digest(source));
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException("every JVM has SHA-1", e);
        }
    }

    /** The script {@code scripts/<name>.lua}, as shipped. */
    private static Script load(String name) {
        try (InputStream in = Script.class.getResourceAsStream("scripts/" + name + ".lua")) {
            if (in == null) {
                throw new IllegalStateException("scripts/" + name + ".lua is missing from the jar");
            }
            return new Script(in.readAllBytes());
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        }
    }

    /** Runs the script; a {@code NOSCRIPT} answer (a restarted server, a {@code SCRIPT FLUSH}) runs it by source. */
    <T> CompletableFuture<T> run(
            RedisClusterAsyncCommands<byte[], byte[]> redis, ScriptOutputType type, byte[][] keys, byte[]... args) {
        return redis.<T>evalsha(sha, type, keys, args).toCompletableFuture().exceptionallyCompose(error -> {
            if (cause(error) instanceof RedisNoScriptException) {
                return redis.<T>eval(source, type, keys, args).toCompletableFuture();
            }
            return CompletableFuture.failedFuture(cause(error));
        });
    }

    /** A call's reply, waited for at most {@code timeout}; its failure as the Redis error it is. */
    static <T> T await(java.util.concurrent.CompletionStage<T> call, java.time.Duration timeout) {
        try {
            return call.toCompletableFuture().get(timeout.toNanos(), java.util.concurrent.TimeUnit.NANOSECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new io.lettuce.core.RedisException("interrupted while waiting for a reply", e);
        } catch (ExecutionException e) {
            Throwable cause = cause(e);
            throw cause instanceof RuntimeException runtime ? runtime : new io.lettuce.core.RedisException(cause);
        } catch (java.util.concurrent.TimeoutException e) {
            throw new io.lettuce.core.RedisCommandTimeoutException("no reply within " + timeout);
        }
    }

    /** The error itself, out of the wrappers futures put around it. */
    static Throwable cause(Throwable error) {
        Throwable cause = error;
        while ((cause instanceof CompletionException || cause instanceof ExecutionException) && cause.getCause() != null) {
            cause = cause.getCause();
        }
        return cause;
    }
}
